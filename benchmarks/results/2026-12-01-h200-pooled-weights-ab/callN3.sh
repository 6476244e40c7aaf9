#!/usr/bin/env bash
# Session 7, call 3: weighted pooled tiles. Hang check, grid, memcheck, native A/B (base vs new, alternating),
# planted pipeline A/B (libraries only).
RET=$OUT; R=$(mktemp -d); B=.carry/bin; n=0
timeout 60 $B/fpv2_hopper_prefill_test --mode small > $R/small.log 2>&1; rc=$?; echo "small rc=$rc pass=$(grep -c '^\[PASS' $R/small.log) fail=$(grep -c '^\[FAIL' $R/small.log)"
if [ $rc -ne 0 ]; then grep FAIL $R/small.log | head; tar czf $RET/callN3.tgz -C "$R" .; exit 1; fi
timeout 250 $B/fpv2_hopper_prefill_test --mode correctness > $R/grid.log 2>&1; echo "grid rc=$? pass $(grep -c '^\[PASS' $R/grid.log) fail $(grep -c '^\[FAIL' $R/grid.log)"
grep '^\[FAIL' $R/grid.log | head -5 | cut -c1-200
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 120 $CS --tool memcheck $B/fpv2_hopper_prefill_test --mode small > $R/memcheck.log 2>&1; echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' $R/memcheck.log | tail -1)"
for V in base new new base; do
  n=$((n+1)); F=$R/timing-$V-$n.log
  if [ $V = base ]; then T=.carry/base/fpv2_hopper_prefill_test; else T=$B/fpv2_hopper_prefill_test; fi
  timeout 100 $T --mode timing --lengths 32768,131072 --repeats 10 --keep 0.03 > $F 2>&1
  echo "timing $V rc=$?"; grep "^\[" $F | grep -E "sparse |corrected " | grep -v e4m3 | sed -E 's/ max\|err.*//; s/.*d=128 page=128 bf16 causal //; s/over 10 runs//' | cut -c1-110
done
export PYTHONPATH=$(ls -d $PWD/packages/*/src | tr '\n' ':')
for L in 131072 32768; do for V in base new new base; do
  n=$((n+1)); F=$R/pipe-$L-$V-$n.log
  if [ $V = base ]; then LIB=$PWD/.carry/base/libfpv2_kernel.so; else LIB=$PWD/.carry/lib/libfpv2_kernel.so; fi
  FPV2_KERNEL_LIBRARY=$LIB timeout 90 python3 .carry/pipe_time.py $L > $F 2>&1; echo "pipe $V rc=$? $(tail -1 $F)"
done; done
tar czf $RET/callN3.tgz -C "$R" .
