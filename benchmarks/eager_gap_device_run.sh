#!/usr/bin/env bash
# Device run: where an eager 128K pipeline call loses the 1.4 ms it spends over its host-ahead time (page 1, the
# Hopper backend, the current library), on the H200, from the repository root.
#
#   benchmarks/eager_gap_device_run.sh probe   eager_attention_probe.py at 128K, corrected and not: the attention
#                                              launch alone back to back (ahead), after a synchronize (eager),
#                                              after 5 ms of idle GPU (idle) and inside an eager pipeline call
#                                              (pipeline), the SM clock read around every sample and sampled
#                                              every 100 ms by nvidia-smi
#   benchmarks/eager_gap_device_run.sh marks   pipeline_profile.py --marks-only at 128K and 32K, page 1: when the
#                                              host issued each launch and when the GPU got past it
#
# Predictions (written before the run), from the 2026-12-05 H100 bench row (index stage 2.62 ms eager against 1.93
# GPU, attention stage 11.67 against 11.15) and the twelfth session's marks (the attention launch queued ~1.2 ms
# before the GPU needs it):
# - marks: the host is behind the GPU only before the pooling launch (0.3-0.5 ms) and between the pooling kernel's
#   end and the scoring launch (0.15-0.3 ms); the attention launch is queued before the index kernels end.
# - probe: `ahead` equals the bench's host-ahead attention (about 11.1 ms on an H100, corrected); `eager` and
#   `idle` about 0.3-0.5 ms slower with a lower SM clock around them (the clock's ramp after idle); `pipeline`
#   close to `idle`. If instead `eager` and `idle` equal `ahead`, the excess is inside the pipeline call (an
#   allocation that synchronises, or the tile-page copy's ordering), and the marks locate it.
#
# Environment: SCORE_BIN folder with libfpv2_kernel.so [.carry/head]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start eager-gap "${1:-probe}" "${SCORE_BIN:-.carry/head}"
RESULTS="$LOGS/results"  # inside the part's archive
mkdir -p "$RESULTS"

if [ "$PART" = probe ]; then
  for correction in "" "--no-correction"; do
    # shellcheck disable=SC2086  # an empty option list is no option
    with_clocks "probe${correction}" with_packages timeout 200 python3 benchmarks/eager_attention_probe.py \
      --seqlen 131072 --page-size 1 $correction --out "$RESULTS/eager-attention.jsonl" \
      > "$LOGS/probe${correction}.log" 2>&1
  done
  python3 -c 'import json,sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["protocol"], r["correction"], r["median_ms"], r["min_ms"], r["sm_mhz_median"], r["sm_mhz_min"])' \
    "$RESULTS/eager-attention.jsonl"
  tail -3 "$LOGS/probe.log"
fi

if [ "$PART" = marks ]; then
  with_packages timeout 240 python3 benchmarks/pipeline_profile.py --seqlen 131072 32768 --page-size 1 \
    --backend hopper --marks-only --repeats 20 --out "$RESULTS/marks" > "$RESULTS/marks.txt" 2>&1
  echo "marks: rc=$?"
  grep -v "^$" "$RESULTS/marks.txt" | tail -30 | cut -c1-140
fi
