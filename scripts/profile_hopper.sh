#!/usr/bin/env bash
# Source-level Nsight Compute profile of the sm_90a prefill kernel's launches, from the repository root.
#
# Runs `fpv2_hopper_prefill_test --mode timing --repeats 1` under ncu (SourceCounters + WarpStateStats with
# the CUDA sources imported) and writes, per profiled launch:
#   ncu-<tag>.txt           the section report (stall reasons, excessive sectors);
#   source-<tag>.csv        the per-SASS-instruction source page (stall samples, executed instructions,
#                           L2 excessive sectors), when this ncu can print it;
#   hot-<tag>.txt           the 60 hottest SASS instructions and the 40 hottest CUDA source lines by stall
#                           samples, and the lines with the most excessive global sectors (scripts/ncu_hotspots.py).
# The device returns only a few files per call: write to a scratch OUT and tar it into the call's $OUT.
# Timing mode runs, per length, dense (warm-up + timed), sparse (2) and sparse with the correction (2):
# launch 2k+1 is the timed one of each, so PROFILE_LAUNCHES="3 5" profiles sparse and corrected.
#
# Environment (defaults in brackets):
#   OUT                 output folder [fpv2-results/hopper-profile]
#   PROFILE_BINARY      test program [/tmp/fpv2-hopper-build/fpv2_hopper_prefill_test]
#   PROFILE_LENGTHS     space-separated lengths, one ncu run each ["32768"]
#   PROFILE_LAUNCHES    0-based prefill_kernel launch numbers to profile in each run ["3 5"]
#   PROFILE_PAGE_SIZE   page size [128]
#   PROFILE_KEEP        sparse keep probability [0.03]
#   NCU                 ncu path [PATH, then /usr/local/cuda/bin/ncu]
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-$ROOT/fpv2-results/hopper-profile}"
mkdir -p "$OUT" || exit 1
BINARY="${PROFILE_BINARY:-/tmp/fpv2-hopper-build/fpv2_hopper_prefill_test}"
LENGTHS="${PROFILE_LENGTHS:-32768}"
LAUNCHES="${PROFILE_LAUNCHES:-3 5}"
PAGE="${PROFILE_PAGE_SIZE:-128}"
KEEP="${PROFILE_KEEP:-0.03}"
NCU="${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}"
[[ -x "$NCU" ]] || { echo "ncu not found"; exit 1; }
[[ -x "$BINARY" ]] || { echo "test program not found: $BINARY"; exit 1; }
"$NCU" --version | tail -1

status=0
for length in $LENGTHS; do
    for launch in $LAUNCHES; do
        tag="L${length}-launch${launch}"
        rep="/tmp/fpv2-profile-$tag"
        echo "=== $tag"
        # --clock-control none: the kernel runs at the clocks it is timed at elsewhere.
        "$NCU" --clock-control none -k regex:prefill_kernel --launch-skip "$launch" --launch-count 1 \
            --section SourceCounters --section WarpStateStats --section SpeedOfLight --import-source yes \
            -f -o "$rep" "$BINARY" --mode timing --lengths "$length" --repeats 1 --keep "$KEEP" \
            --page-size "$PAGE" >"$OUT/run-$tag.log" 2>&1 || { echo "ncu failed ($tag)"; status=1; continue; }
        grep -E "^\[(PASS|FAIL)\]" "$OUT/run-$tag.log" | cut -c1-160
        "$NCU" --import "$rep.ncu-rep" --print-details all >"$OUT/ncu-$tag.txt" 2>&1
        if "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass >"$OUT/source-$tag.csv" 2>"$OUT/source-$tag.err"; then
            python3 scripts/ncu_hotspots.py "$OUT/source-$tag.csv" >"$OUT/hot-$tag.txt" 2>&1 ||
                echo "hotspot summary failed ($tag)"
            head -40 "$OUT/hot-$tag.txt"
        else
            echo "this ncu cannot print the source page: $(head -3 "$OUT/source-$tag.err")"
        fi
        "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source cuda,sass >"$OUT/source-cuda-$tag.csv" \
            2>>"$OUT/source-$tag.err" || true
        rm -f "$rep.ncu-rep"
    done
done
exit $status
