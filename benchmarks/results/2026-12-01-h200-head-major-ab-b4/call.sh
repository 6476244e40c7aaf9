#!/usr/bin/env bash
# Head-major tile order: a second native pair (random CSR) and the 4 x 128K pipeline A/B (planted).
RET=$OUT; R=$(mktemp -d); B=.carry/bin
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')
export FPV2_KERNEL_LIBRARY=$PWD/.carry/lib/libfpv2_kernel.so FPV2_COMMIT=$(cat .carry/TREE_COMMIT)
for H in 1 0; do
  FPV2_HOPPER_HEAD_MAJOR=$H timeout 60 $B/prefill_test_after --mode timing --lengths 131072 --repeats 10 > $R/timing-head$H.log 2>&1
  echo "native head_major=$H rc=$?"; grep '^\[' $R/timing-head$H.log | grep -oE 'fpv2-hopper-[a-z0-9-]+ +density [0-9.]+: median [0-9.]+ ms' | sed 's/density [0-9.]*: //' | tr '\n' ' '; echo
done
for H in 1 0; do
  FPV2_HOPPER_HEAD_MAJOR=$H timeout 200 python3 -m fpv2.serving bench -B 4 -L 131072 --page-size 128 --alpha 0.1 --no-progress --out $R/bench-B4-head$H > $R/bench-B4-head$H.log 2>&1
  echo "B=4 L=131072 head_major=$H rc=$?"; grep "│ fpv2-sparse\|│ fpv2-dense" $R/bench-B4-head$H.log | cut -c1-150
done
tar czf $RET/callH.tgz -C "$R" .
