#!/usr/bin/env bash
# This commit's library under the correction, serving and index packages' GPU tests.
RET=$OUT; R=$(mktemp -d)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so
for P in correction:60 serving:230 index:110; do
  N=${P%%:*}; T=${P##*:}
  timeout $T python3 -m pytest -q -p no:cacheprovider -m gpu packages/fpv2-$N/tests --junitxml=$R/pytest-gpu-$N.xml > $R/pytest-gpu-$N.log 2>&1; echo "pytest $N gpu rc=$?"; tail -1 $R/pytest-gpu-$N.log | cut -c1-200
  grep -E "^FAILED|^ERROR" $R/pytest-gpu-$N.log | head -5 | cut -c1-200
done
tar czf $RET/callM11.tgz -C "$R" .
