#!/bin/bash
# d=256 consumer registers 232/32 (a) vs 240/24 (b): b's small + grid, then alternating native timings.
R=$OUT
timeout 90 .carry/d256b/fpv2_hopper_prefill_test --mode small > $R/b-small.log 2>&1; echo "b small rc=$?"
timeout 240 .carry/d256b/fpv2_hopper_prefill_test --mode correctness --seed 8 > $R/b-correctness.log 2>&1; echo "b correctness rc=$? $(tail -1 $R/b-correctness.log)"
n=0
for V in a b b a; do
  n=$((n+1))
  timeout 120 .carry/d256$V/fpv2_hopper_prefill_test --mode timing --head-dim 256 --lengths 32768,131072 --keep 0.03 --repeats 10 > $R/timing-$n-$V.log 2>&1
  echo "timing $n $V rc=$?"; grep "^\[PASS\]\|^\[FAIL\]" $R/timing-$n-$V.log | sed -E 's/.*L=([0-9]+).*(fpv2-hopper-[a-z-]+) +density ([0-9.]+): median ([0-9.]+) ms.*/\1 \2 \3 \4/'
done
n=0
for V in a b; do n=$((n+1))
  FPV2_HOPPER_OVERLAP=0 timeout 120 .carry/d256$V/fpv2_hopper_prefill_test --mode timing --head-dim 256 --lengths 32768 --keep 0.03 --repeats 10 > $R/timing-ov0-$V.log 2>&1
  echo "timing ov0 $V rc=$?"; grep "^\[PASS\]\|^\[FAIL\]" $R/timing-ov0-$V.log | sed -E 's/.*L=([0-9]+).*(fpv2-hopper-[a-z-]+) +density ([0-9.]+): median ([0-9.]+) ms.*/\1 \2 \3 \4/'
done
timeout 90 .carry/d256b/fpv2_hopper_prefill_test --mode timing --head-dim 256 --page-size 1 --lengths 32768 --keep 0.03 --repeats 5 > $R/timing-b-page1.log 2>&1; echo "b page1 rc=$?"
grep "^\[PASS\]\|^\[FAIL\]" $R/timing-b-page1.log | sed -E 's/.*L=([0-9]+).*(fpv2-hopper-[a-z-]+) +density ([0-9.]+): median ([0-9.]+) ms.*/\1 \2 \3 \4/'
