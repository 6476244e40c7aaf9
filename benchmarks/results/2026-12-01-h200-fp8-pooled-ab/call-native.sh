#!/usr/bin/env bash
# FP8 pooled products: hang check, grid, timing (native test binary).
RET=$OUT; R=$(mktemp -d); B=.carry/bin
$B/fpv2_hopper_layout_check > $R/layout.log 2>&1; echo "layout rc=$?"; tail -1 $R/layout.log
timeout 90 $B/fpv2_hopper_prefill_test --mode small > $R/small.log 2>&1; rc=$?; echo "small rc=$rc"
grep -c PASS $R/small.log; grep "FAIL\|corr8" $R/small.log | cut -c1-260 | head -20
if [ $rc -ne 0 ]; then tar czf $RET/callA.tgz -C "$R" .; exit 1; fi
timeout 150 $B/fpv2_hopper_prefill_test --mode timing --lengths 32768,131072 --repeats 10 > $R/timing.log 2>&1; echo "timing rc=$?"
grep "^\[" $R/timing.log | sed 's/Hq=32 Hkv=8 //' | cut -c1-330
timeout 240 $B/fpv2_hopper_prefill_test --mode correctness > $R/grid.log 2>&1; echo "grid rc=$?"
echo "grid pass $(grep -c '^\[PASS' $R/grid.log) fail $(grep -c '^\[FAIL' $R/grid.log)"; grep "^\[FAIL" $R/grid.log | cut -c1-250 | head -10
grep "corr8" $R/grid.log | awk '{for(i=1;i<=NF;i++) if($i ~ /max\|err\||rel_rms|lse_err/) printf "%s ", $i; print ""}' | sort | tail -5
tar czf $RET/callA.tgz -C "$R" .
