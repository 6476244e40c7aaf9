#!/usr/bin/env bash
# Persistent CTAs with the overlapped consumers and the next tile's Q issued before the epilogue: hang check,
# alternating timing (default one-CTA-per-tile vs FPV2_HOPPER_PERSISTENT=1), grid under PERSISTENT=1.
RET=$OUT; R=$(mktemp -d); B=.carry/bin; n=0
FPV2_HOPPER_PERSISTENT=1 timeout 60 $B/fpv2_hopper_prefill_test --mode small > $R/small-persistent.log 2>&1; rc=$?; echo "small persistent rc=$rc (e4m3 variant refused by design)"; grep -c "^\[PASS" $R/small-persistent.log
if [ $rc -eq 124 ] || [ $rc -gt 1 ]; then tar czf $RET/callM5.tgz -C "$R" .; exit 1; fi
for K in 0.0 0.03; do for P in 0 1 1 0; do
  n=$((n+1)); F=$R/timing-persistent$P-keep$K-$n.log
  FPV2_HOPPER_PERSISTENT=$P timeout 100 $B/fpv2_hopper_prefill_test --mode timing --lengths 32768,131072 --repeats 10 --keep $K > $F 2>&1
  echo "persistent=$P keep=$K rc=$?"; grep "^\[" $F | grep -E "sparse |corrected |dense " | sed -E 's/ max\|err.*//; s/.*d=128 page=128 bf16 causal //; s/over 10 runs//' | cut -c1-100
done; done
FPV2_HOPPER_PERSISTENT=1 timeout 250 $B/fpv2_hopper_prefill_test --mode correctness > $R/grid-persistent.log 2>&1; echo "grid rc=$?"
echo "grid pass $(grep -c '^\[PASS' $R/grid-persistent.log) fail $(grep -c '^\[FAIL' $R/grid-persistent.log)"; grep "^\[FAIL" $R/grid-persistent.log | cut -c1-160 | sort | uniq -c | sort -rn | head -5
tar czf $RET/callM5.tgz -C "$R" .
