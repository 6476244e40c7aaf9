#!/usr/bin/env bash
# Session 7, call 6: the other packages' GPU tests on the session's end state, and the 4 x 128K bench.
RET=$OUT; R=$(mktemp -d)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/FINAL_COMMIT)
for P in correction:60 index:110 serving:230; do
  N=${P%%:*}; T=${P##*:}
  timeout $T python3 -m pytest -q -p no:cacheprovider -m "gpu or hopper" packages/fpv2-$N/tests --junitxml=$R/pytest-gpu-$N.xml > $R/pytest-gpu-$N.log 2>&1; echo "pytest $N gpu rc=$?"; tail -1 $R/pytest-gpu-$N.log | cut -c1-200
  grep -E "^FAILED|^ERROR" $R/pytest-gpu-$N.log | head -5 | cut -c1-200
done
F=$R/bench-4x128k; timeout 170 python3 -m fpv2.serving bench -B 4 -L 131072 --page-size 128 --alpha 0.1 --no-progress --out $F > $F.log 2>&1
echo "bench 4x128K rc=$?"; grep -E "│ fpv2-(sparse|dense)|cudnn" $F.log | cut -c1-170
tar czf $RET/callN6.tgz -C "$R" .
