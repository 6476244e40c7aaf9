#!/bin/bash
# d=256 first device run: hang check, grid, timings, memcheck small.
B=build/kernel/fpv2_hopper_prefill_test
R=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader > $R/gpu.txt
timeout 90 $B --mode small > $R/small.log 2>&1; echo "small rc=$?" | tee -a $R/rc.txt
grep -q "rc=0" $R/rc.txt || exit 0
timeout 240 $B --mode correctness > $R/correctness.log 2>&1; echo "correctness rc=$?" | tee -a $R/rc.txt
tail -2 $R/correctness.log
timeout 120 $B --mode timing --head-dim 256 --lengths 32768,131072 --keep 0.03 --repeats 10 > $R/timing-d256.log 2>&1; echo "timing256 rc=$?" | tee -a $R/rc.txt
FPV2_HOPPER_OVERLAP=0 timeout 120 $B --mode timing --head-dim 256 --lengths 32768,131072 --keep 0.03 --repeats 10 > $R/timing-d256-overlap0.log 2>&1; echo "timing256-ov0 rc=$?" | tee -a $R/rc.txt
timeout 60 $B --mode timing --head-dim 128 --lengths 32768 --keep 0.03 --repeats 10 > $R/timing-d128.log 2>&1; echo "timing128 rc=$?" | tee -a $R/rc.txt
CS=$(ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
[ -n "$CS" ] && timeout 120 $CS --tool memcheck $B --mode small > $R/memcheck-small.log 2>&1; echo "memcheck rc=$?" | tee -a $R/rc.txt
tail -3 $R/memcheck-small.log
grep -h "TFLOP\|ms" $R/timing-*.log | grep -v "^\[PASS\].*small" | head -40
