#!/usr/bin/env bash
# Head-major tile order (FPV2_HOPPER_HEAD_MAJOR): hang check, native A/B (random CSR), pipeline A/B (planted), grid.
RET=$OUT; R=$(mktemp -d); B=.carry/bin
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')
export FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/TREE_COMMIT)
FPV2_HOPPER_HEAD_MAJOR=1 timeout 60 $B/prefill_test_after --mode small > $R/small.log 2>&1; rc=$?; echo "small rc=$rc"
if [ $rc -ne 0 ]; then tar czf $RET/callG.tgz -C "$R" .; exit 1; fi
for H in 0 1; do
  FPV2_HOPPER_HEAD_MAJOR=$H timeout 100 $B/prefill_test_after --mode timing --lengths 32768,131072 --repeats 10 > $R/timing-head$H.log 2>&1
  echo "native head_major=$H rc=$?"; grep '^\[' $R/timing-head$H.log | grep -oE 'L=[0-9]+|fpv2-hopper-[a-z0-9-]+ +density [0-9.]+: median [0-9.]+ ms' | sed 's/density [0-9.]*: //' | tr '\n' ' '; echo
done
n=0
for LH in 32768:0 32768:1 131072:0 131072:1 131072:0 131072:1; do L=${LH%:*}; H=${LH#*:}; n=$((n+1))
  FPV2_HOPPER_HEAD_MAJOR=$H timeout 100 python3 -m fpv2.serving bench -B 1 -L $L --page-size 128 --alpha 0.1 --no-progress --out $R/bench-$n-L$L-head$H > $R/bench-$n-L$L-head$H.log 2>&1
  echo "L=$L head_major=$H rc=$?"; grep "│ fpv2-sparse\|│ fpv2-dense" $R/bench-$n-L$L-head$H.log | cut -c1-150
done
FPV2_HOPPER_HEAD_MAJOR=1 timeout 150 $B/prefill_test_after --mode correctness > $R/grid.log 2>&1; echo "grid rc=$?"
echo "grid pass $(grep -c '^\[PASS' $R/grid.log) fail $(grep -c '^\[FAIL' $R/grid.log)"
tar czf $RET/callG.tgz -C "$R" .
