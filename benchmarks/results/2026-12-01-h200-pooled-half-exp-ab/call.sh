#!/usr/bin/env bash
# fp16x2 exponentials on the pooled tiles (FPV2_HOPPER_POOLED_HALF_EXP): grid with it on, alternating timing A/B.
RET=$OUT; R=$(mktemp -d); B=.carry/bin
FPV2_HOPPER_POOLED_HALF_EXP=1 timeout 60 $B/fpv2_hopper_prefill_test --mode small > $R/small-half.log 2>&1; rc=$?; echo "small rc=$rc"
if [ $rc -gt 1 ] || [ $rc -eq 124 ]; then tar czf $RET/callD.tgz -C "$R" .; exit 1; fi
for run in 1 2; do for E in 0 1; do
  FPV2_HOPPER_POOLED_HALF_EXP=$E timeout 100 $B/fpv2_hopper_prefill_test --mode timing --lengths 32768,131072 --repeats 10 > $R/timing-half$E-run$run.log 2>&1
  echo "half=$E run=$run rc=$?"; grep "^\[" $R/timing-half$E-run$run.log | grep "corrected " | sed -E 's/.*L=([0-9]+).*median ([0-9.]+) ms.*overhead ([0-9.]+%).*max\|err\|=([^ ]+) rel_rms=([^ ]+) lse_err=([^ ]+)/L=\1 \2 ms corr \3 err \4 \5 \6/'
done; done
FPV2_HOPPER_POOLED_HALF_EXP=1 timeout 200 $B/fpv2_hopper_prefill_test --mode correctness > $R/grid-half.log 2>&1; echo "grid rc=$?"
echo "grid pass $(grep -c '^\[PASS' $R/grid-half.log) fail $(grep -c '^\[FAIL' $R/grid-half.log)"; grep "^\[FAIL" $R/grid-half.log | cut -c1-60,120-240 | head -6
grep "sparse+corr " $R/grid-half.log | grep -oE "rel_rms=[^ ]+ lse_err=[^ ]+" | sort -t= -k3 | tail -3
tar czf $RET/callD.tgz -C "$R" .
