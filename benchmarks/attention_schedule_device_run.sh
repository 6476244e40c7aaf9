#!/usr/bin/env bash
# Device run: the Hopper attention kernel's tile schedules re-timed on the planted pipeline with today's kernel
# (one CTA per tile, the default, against the opt-in persistent CTAs of FPV2_HOPPER_PERSISTENT), from the
# repository root, with the library built on the development machine. Written in the 32nd session.
#
#   benchmarks/attention_schedule_device_run.sh probe  attention_switch_probe.py with FPV2_HOPPER_PERSISTENT
#                                                      alternating 0 / 1 / dynamic in one process: 128K B = 1
#                                                      (correction off and mean) and 4 x 128K (mean), page 1
#   benchmarks/attention_schedule_device_run.sh rows   fpv2 bench --sparse-only rows at 128K, page 1, mean
#                                                      correction, FPV2_HOPPER_PERSISTENT=0 and =$SETTING
#                                                      [dynamic] alternating, A B B A, one process a row
#
# Why (NOTES.md, tenth session): with only the forced blocks a tile (keep 0) the dynamic queue was 21% faster
# than one CTA per tile at 128K, about 1.6 us a tile, the prologue and epilogue that a persistent CTA hides. At the
# planted workload's ~24 steps a tile (~40 us) that is ~4% of the kernel, yet the planted pipeline was a tie then
# (13.600 against 13.646 ms). The kernel has changed much since (overlapped consumers everywhere, the correction's
# table built by the producer's idle warps for one CTA per tile, scoring and copies moved), and no schedule has been
# timed on it since.
#
# Predictions (written before the run):
# - probe, 128K mean: dynamic -3% to +2% against one CTA per tile, snake (1) +0 to +5%; correction off the same
#   within 2 points; 4 x 128K as 128K. The outputs equal (max difference 0: the same blocks in the same order per
#   tile). If dynamic wins by >= 2% at both sizes it is worth making the default for large calls (rows decide).
# - rows: as the probe's difference, within the rows' spread (~1%).
#
# Measured (32nd session, H100; results/2026-12-06-h100-attention-schedule/): dynamic -2.3% at 128K mean, +1.0% off,
# -0.7% at 4 x 128K; rows -1.1% (inside their spread). Snake +2.6 to +11.9%. The default stays one CTA per tile.
#
# Environment: BIN folder with the shipped libfpv2_kernel.so [.carry/head]; SETTING [dynamic]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start attention-schedule "${1:-probe}" "${BIN:-.carry/head}"
RESULTS="$LOGS/results"  # inside the part's archive: the device returns files at most two folders down
mkdir -p "$RESULTS"

if [ "$PART" = probe ]; then
  for shape in "1 off,mean" "4 mean"; do
    read -r batch modes <<< "$shape"
    with_packages timeout 200 python3 benchmarks/attention_switch_probe.py --switch FPV2_HOPPER_PERSISTENT \
      --settings 0,1,dynamic --seqlen 131072 --batch "$batch" --modes "$modes" --rounds 8 --calls 3 \
      --label "B$batch" >> "$RESULTS/persistent-probe.jsonl" 2> "$LOGS/probe-b$batch.log"
    echo "probe B=$batch: rc=$?"
  done
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    base = r["median_ms"]["0"]
    print("B", r["batch"], r["mode"], {s: f"{m:.3f} ({100 * (m / base - 1):+.1f}%)" for s, m in r["median_ms"].items()},
          "max diff", r["max_abs_difference_vs_0"])' "$RESULTS/persistent-probe.jsonl"
fi

if [ "$PART" = rows ]; then
  setting="${SETTING:-dynamic}"
  for value in 0 "$setting" "$setting" 0; do
    run=$((${run:-0} + 1))
    FPV2_HOPPER_PERSISTENT="$value" bench_row 1 131072 "bench-128k-$run-persistent-$value" 120 --page-size 1 \
      --backend hopper --sparse-only
  done
  python3 - "$RESULTS" <<'EOF'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*/bench-*.json")):
    for r in json.loads(path.read_text())["rows"]:
        if r["impl"].startswith("fpv2-sparse"):
            print(path.parent.name, "ms", round(r["ms"], 3), "gpu_ms", round(r["gpu_ms"], 3),
                  "attn", round(r["gpu_attention_ms"], 3), "err", round(r["rel_err"], 4))
EOF
fi
