#!/usr/bin/env bash
# The correction's shift table built by the producer's idle warps: hang check, grid, alternating A/B.
RET=$OUT; R=$(mktemp -d); B=.carry/bin
timeout 60 $B/prefill_test_after --mode small > $R/small.log 2>&1; rc=$?; echo "small rc=$rc"; grep -c PASS $R/small.log
if [ $rc -ne 0 ]; then tar czf $RET/callE.tgz -C "$R" .; exit 1; fi
for run in 1 2 3; do for V in before after; do
  timeout 100 $B/prefill_test_$V --mode timing --lengths 32768,131072 --repeats 10 > $R/timing-$V-run$run.log 2>&1
  echo "$V run=$run rc=$?"; grep "^\[" $R/timing-$V-run$run.log | grep -v dense | sed -E 's/.*L=([0-9]+).*causal ([a-z0-9-]+) .*median ([0-9.]+) ms.*overhead ([0-9.]+%).*/L=\1 \2 \3 ms corr \4/'
done; done
timeout 200 $B/prefill_test_after --mode correctness > $R/grid.log 2>&1; echo "grid rc=$?"
echo "grid pass $(grep -c '^\[PASS' $R/grid.log) fail $(grep -c '^\[FAIL' $R/grid.log)"; grep "^\[FAIL" $R/grid.log | cut -c1-200 | head -6
tar czf $RET/callE.tgz -C "$R" .
