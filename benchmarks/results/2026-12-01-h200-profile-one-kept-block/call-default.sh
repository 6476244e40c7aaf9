#!/usr/bin/env bash
# Source-level profile of the sparse kernel with one kept block per tile (keep 0, 32K): where a CTA's fixed
# ~8 us go.
RET=$OUT; R=$(mktemp -d)
OUT=$R PROFILE_BINARY=.carry/bin/fpv2_hopper_prefill_test PROFILE_LENGTHS=32768 PROFILE_LAUNCHES="3 5" PROFILE_KEEP=0.0 \
  timeout 400 bash scripts/profile_hopper.sh > $R/profile.log 2>&1; echo "profile rc=$?"
head -50 $R/profile.log | cut -c1-180
for f in $R/ncu-*.txt; do echo "== $f"; grep -E "Elapsed Cycles|SM Active Cycles|Duration|Achieved Occupancy|Warp Cycles Per Issued|Compute \(SM\) Throughput" $f | head -8; done
tar czf $RET/callM2.tgz -C "$R" .
