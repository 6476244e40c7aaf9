#!/usr/bin/env bash
# Device run (probe run 2026-12-05: results/2026-12-05-h200-clock-state/, no measurable effect): how much a sparse pipeline timing
# depends on the GPU's power state left by the row before it; from the repository root, with the library built on
# the development machine.
#
#   benchmarks/clock_state_device_run.sh [probe]  benchmarks/clock_state_probe.py at 1 x 128K, 4 x 128K and 1 x 32K
#                                                 (page 1): the corrected pipeline after 3 s of dense calls, after 3 s
#                                                 idle, and after 1.5 s of its own calls, twice each
#   benchmarks/clock_state_device_run.sh bench    fpv2 bench at 1 x 128K and 4 x 128K (page 1) with --warmup-ms 0 and
#                                                 1500, alternating, the SM clock sampled every 100 ms
#
# Prediction (written before any run): the dense baselines leave the board at its power cap with the SM clock at
# 1500-1700 MHz (standard-shapes/clocks); a 128K call's attention kernel streams K/V (DRAM) but its wgmma and
# exponential work follow the SM clock, so the first calls after the baselines run 3-8% slower than the same
# calls after an idle GPU (128K: 14.1 -> 13.0-13.7 ms eager), and the pipeline's own steady state lies between
# the two if it draws less than the 700 W cap. `after-dense` = today's bench protocol.
#
# Environment: SCORE_BIN folder with libfpv2_kernel.so [.carry/head]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start clock-state "${1:-probe}" "${SCORE_BIN:-.carry/head}"
RESULTS="$LOGS/results"  # inside the part's archive: the device returns a few files a call
mkdir -p "$RESULTS"

if [ "$PART" = probe ]; then
  with_packages timeout 400 python3 benchmarks/clock_state_probe.py --shapes 1x131072 4x131072 1x32768 \
    --out "$RESULTS/clock-state-probe.json" > "$LOGS/probe.log" 2>&1
  echo "probe: rc=$?"
  grep -v Warning "$LOGS/probe.log" | tail -16
fi

if [ "$PART" = bench ]; then
  run=0
  for warm in 0 1500 1500 0; do  # A B B A
    run=$((run + 1))
    with_clocks "128k-$run-warm$warm" bench_row 1 131072 "bench-128k-$run-warm$warm" 200 --page-size 1 \
      --warmup-ms "$warm"
  done
  with_clocks 4x128k-warm0 bench_row 4 131072 bench-4x128k-warm0 280 --page-size 1 --warmup-ms 0
  with_clocks 4x128k-warm1500 bench_row 4 131072 bench-4x128k-warm1500 300 --page-size 1 --warmup-ms 1500
fi
