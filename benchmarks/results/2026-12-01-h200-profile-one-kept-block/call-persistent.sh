#!/usr/bin/env bash
# Source-level profile of the persistent overlapped kernel, one kept block per tile (keep 0, 32K). The test
# program exits 1 (its e4m3 variant is refused with persistent CTAs, by design), so ncu's status is ignored.
RET=$OUT; R=$(mktemp -d); NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu); rep=$R/persistent-keep0
FPV2_HOPPER_PERSISTENT=1 timeout 200 $NCU --clock-control none -k regex:prefill_kernel --launch-skip 3 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source yes -f -o $rep \
  .carry/bin/fpv2_hopper_prefill_test --mode timing --lengths 32768 --repeats 1 --keep 0.0 > $R/run.log 2>&1; echo "ncu rc=$?"
$NCU --import $rep.ncu-rep --print-details all > $R/ncu-persistent-keep0.txt 2>&1
$NCU --import $rep.ncu-rep --page source --csv --print-source cuda,sass > $R/source-cuda-persistent-keep0.csv 2> $R/source.err
grep -E "Elapsed Cycles|SM Active Cycles|Duration|Warp Cycles Per Issued" $R/ncu-persistent-keep0.txt | head -5
rm -f $rep.ncu-rep
tar czf $RET/callM6.tgz -C "$R" .
