#!/bin/bash
# Split-KV: hang check, grids (auto and forced 3 splits), memcheck, the default path against the pre-split
# build (alternating), chunk timings with and without splits, the binding's split tests.
R=$OUT; N=.carry/split/fpv2_hopper_prefill_test; P=.carry/d256b/fpv2_hopper_prefill_test
short() { grep "^\[PASS\]\|^\[FAIL\]" $1 | sed -E 's/.*L=([0-9]+) Q=([0-9]+).*(fpv2-hopper-[a-z0-9-]+) +density ([0-9.]+): median ([0-9.]+) ms.*/\1 \2 \3 \4 \5/; s/.*L=([0-9]+) B.*(fpv2-hopper-[a-z0-9-]+) +density ([0-9.]+): median ([0-9.]+) ms.*/\1 \2 \3 \4/'; }
timeout 60 $N --mode small > $R/small.log 2>&1; echo "small rc=$?"
FPV2_HOPPER_SPLITS=3 timeout 60 $N --mode small > $R/small-split3.log 2>&1; echo "small split3 rc=$?"
grep -q "rc=0" <(echo) ; tail -1 $R/small-split3.log
timeout 200 $N --mode correctness --seed 11 > $R/correctness.log 2>&1; echo "grid rc=$? $(tail -1 $R/correctness.log)"
FPV2_HOPPER_SPLITS=3 timeout 200 $N --mode correctness --seed 12 > $R/correctness-split3.log 2>&1; echo "grid split3 rc=$? $(tail -1 $R/correctness-split3.log)"
CS=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
FPV2_HOPPER_SPLITS=3 timeout 100 $CS --tool memcheck $N --mode small > $R/memcheck-split3.log 2>&1; echo "memcheck split3 rc=$? $(grep 'ERROR SUMMARY' $R/memcheck-split3.log)"
n=0; for V in P N N P; do n=$((n+1)); B=$P; [ $V = N ] && B=$N
  timeout 100 $B --mode timing --lengths 32768,131072 --keep 0.03 --repeats 10 > $R/default-$n-$V.log 2>&1; echo "default $n $V rc=$?"; short $R/default-$n-$V.log; done
for Q in 128 512 2048; do for S in 1 auto; do
  if [ $S = auto ]; then unset FPV2_HOPPER_SPLITS; else export FPV2_HOPPER_SPLITS=$S; fi
  timeout 60 $N --mode timing --lengths 131072 --query-len $Q --keep 0.03 --repeats 20 > $R/chunk-q$Q-s$S.log 2>&1; echo "chunk Q=$Q splits=$S rc=$? ws=$(grep -o '"workspace_bytes": [0-9]*' $R/chunk-q$Q-s$S.log | head -1)"; short $R/chunk-q$Q-s$S.log
done; done; unset FPV2_HOPPER_SPLITS
timeout 60 $N --mode timing --head-dim 256 --lengths 131072 --query-len 512 --keep 0.03 --repeats 20 > $R/chunk-d256-q512-auto.log 2>&1; echo "d256 chunk rc=$?"; short $R/chunk-d256-q512-auto.log
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':') FPV2_KERNEL_LIBRARY=$PWD/.carry/split/libfpv2_kernel.so
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or hopper" packages/fpv2-kernel/tests/test_hopper_kernel.py > $R/pytest-hopper.log 2>&1; echo "pytest hopper rc=$?"; tail -1 $R/pytest-hopper.log | cut -c1-200; grep -E "^FAILED|^ERROR" $R/pytest-hopper.log | head -5 | cut -c1-250
