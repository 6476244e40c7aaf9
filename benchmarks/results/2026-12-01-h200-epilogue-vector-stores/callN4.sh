#!/usr/bin/env bash
# Session 7, call 4: 16-byte epilogue stores (quad transpose): hang check, grid, memcheck, native A/B; launch
# cost micro-benchmark; planted pipeline A/B of the host trims (start-of-session tree vs the helper's commits).
RET=$OUT; R=$(mktemp -d); B=.carry/bin; n=0
timeout 60 $B/fpv2_hopper_prefill_test --mode small > $R/small.log 2>&1; rc=$?; echo "small rc=$rc pass=$(grep -c '^\[PASS' $R/small.log) fail=$(grep -c '^\[FAIL' $R/small.log)"
if [ $rc -ne 0 ]; then grep FAIL $R/small.log | head; tar czf $RET/callN4.tgz -C "$R" .; exit 1; fi
timeout 250 $B/fpv2_hopper_prefill_test --mode correctness > $R/grid.log 2>&1; echo "grid rc=$? pass $(grep -c '^\[PASS' $R/grid.log) fail $(grep -c '^\[FAIL' $R/grid.log)"
grep '^\[FAIL' $R/grid.log | head -5 | cut -c1-200
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 120 $CS --tool memcheck $B/fpv2_hopper_prefill_test --mode small > $R/memcheck.log 2>&1; echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' $R/memcheck.log | tail -1)"
for K in 0.03 0.0; do for V in base new new base; do
  n=$((n+1)); F=$R/timing-keep$K-$V-$n.log
  if [ $V = base ]; then T=.carry/base/fpv2_hopper_prefill_test; else T=$B/fpv2_hopper_prefill_test; fi
  timeout 100 $T --mode timing --lengths 32768,131072 --repeats 10 --keep $K > $F 2>&1
  echo "timing keep=$K $V rc=$?"; grep "^\[" $F | grep -E "dense |sparse |corrected " | grep -v e4m3 | sed -E 's/ max\|err.*//; s/.*d=128 page=128 bf16 causal //; s/over 10 runs//' | cut -c1-100
done; done
mkdir -p $R/src-base $R/src-head; tar xf .carry/base-src.tar -C $R/src-base; tar xf .carry/head-src.tar -C $R/src-head
export FPV2_KERNEL_LIBRARY=$PWD/.carry/base/libfpv2_kernel.so
PYTHONPATH=$(ls -d $R/src-head/packages/*/src | tr '\n' ':') timeout 60 python3 .carry/launch_costs.py > $R/launch-costs.log 2>&1; echo "launch costs rc=$?"; cat $R/launch-costs.log | cut -c1-110
for L in 131072 32768; do for V in base head head base; do
  n=$((n+1)); F=$R/pipe-$L-$V-$n.log
  PYTHONPATH=$(ls -d $R/src-$V/packages/*/src | tr '\n' ':') timeout 90 python3 .carry/pipe_time.py $L > $F 2>&1; echo "pipe $V rc=$? $(tail -1 $F)"
done; done
PYTHONPATH=$(ls -d $R/src-head/packages/*/src | tr '\n' ':') timeout 100 python3 $R/src-head/benchmarks/pipeline_profile.py --seqlen 32768 131072 --repeats 50 --host-breakdown --out $R/breakdown-head > $R/breakdown-head.log 2>&1; echo "breakdown rc=$?"
grep -E "==|whole|mark|pool_blocks|select_blocks|hopper_prefill|prefill_args|launch_pool" $R/breakdown-head.log | grep -v uncorrected -A0 | head -24
tar czf $RET/callN4.tgz -C "$R" .
