#!/usr/bin/env bash
# Pipeline A/B of the FP8 pooled products (FPV2_HOPPER_POOLED_E4M3), the kernel package's GPU tests, host marks.
RET=$OUT; R=$(mktemp -d)
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')
export FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/TREE_COMMIT)
for L in 32768 131072; do for E in 0 1; do
  FPV2_HOPPER_POOLED_E4M3=$E timeout 100 python3 -m fpv2.serving bench -B 1 -L $L --page-size 128 --alpha 0.1 --no-progress --out $R/bench-L$L-e4m3-$E > $R/bench-L$L-e4m3-$E.log 2>&1
  echo "L=$L e4m3=$E rc=$?"; grep -iE "pipeline|index|attention|error|dense" $R/bench-L$L-e4m3-$E.log | grep -v Warn | head -12
done; done
timeout 60 python3 benchmarks/pipeline_profile.py --marks-only --seqlen 32768 131072 --page-size 128 --repeats 10 --out $R/marks > $R/marks.log 2>&1; echo "marks rc=$?"
grep -v Warn $R/marks.log | tail -30
FPV2_REQUIRE_NATIVE=1 timeout 200 python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" packages/fpv2-kernel/tests > $R/pytest-kernel.log 2>&1; echo "pytest rc=$?"; tail -3 $R/pytest-kernel.log
tar czf $RET/callB.tgz -C "$R" .
