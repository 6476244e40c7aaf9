#!/usr/bin/env bash
# Epilogue through shared memory (16-byte stores) + precomputed divisions: hang check, grid, alternating timing.
RET=$OUT; R=$(mktemp -d); B=.carry/bin; O=.carry/bin-old
timeout 60 $B/fpv2_hopper_prefill_test --mode small > $R/small.log 2>&1; rc=$?; echo "small rc=$rc"; tail -2 $R/small.log | cut -c1-200
if [ $rc -eq 124 ] || [ $rc -gt 1 ]; then tar czf $RET/callM3.tgz -C "$R" .; exit 1; fi
FPV2_HOPPER_PERSISTENT=1 timeout 60 $B/fpv2_hopper_prefill_test --mode small > $R/small-persistent.log 2>&1; echo "small persistent rc=$?"
FPV2_HOPPER_OVERLAP=0 timeout 60 $B/fpv2_hopper_prefill_test --mode small > $R/small-nooverlap.log 2>&1; echo "small no-overlap rc=$?"
for K in 0.0 0.03; do for V in old new new old; do
  if [ $V = old ]; then BIN=$O; else BIN=$B; fi
  timeout 100 $BIN/fpv2_hopper_prefill_test --mode timing --lengths 32768,131072 --repeats 10 --keep $K > $R/timing-$V-keep$K-$((n=n+1)).log 2>&1
  echo "$V keep=$K rc=$?"; grep "^\[" $R/timing-$V-keep$K-$n.log | grep -E "sparse |corrected |dense " | sed -E 's/ max\|err.*//; s/.*d=128 page=128 bf16 causal //' | cut -c1-110
done; done
timeout 250 $B/fpv2_hopper_prefill_test --mode correctness > $R/grid.log 2>&1; echo "grid rc=$?"
echo "grid pass $(grep -c '^\[PASS' $R/grid.log) fail $(grep -c '^\[FAIL' $R/grid.log)"; grep "^\[FAIL" $R/grid.log | cut -c1-200 | head -6
tar czf $RET/callM3.tgz -C "$R" .
