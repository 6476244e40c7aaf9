#!/usr/bin/env bash
# Device run: scoring pass 1 carrying the mean correction's pooled terms (fpv2.index.triton.corrected_scoring),
# from the repository root, with the library built on the development machine.
#
#   benchmarks/corrected_scoring_device_run.sh [speed]  the module's tests compiled on the GPU (against float64),
#                                      then benchmarks/corrected_scoring_speed.py at 32K, 128K and 4 x 128K
#
# Prediction (written before the run): the energies-only pass in the row-major orientation costs about what the
# fused Triton pass does (1.5-1.7 ms at 128K: the same logits and exponentials, a row maximum instead of a block
# maximum); the pooled terms add one m128n128k64 product per step and the rescale of a 128 x 128 accumulator:
# +0.6-1.0 ms at 128K. The attention kernel's correction costs 2.3-3.5 ms there today, so the pass is worth
# building out (selection, kept-term subtraction, merge) if it stays under about +1.5 ms.
#
# Environment: SCORE_BIN folder with libfpv2_kernel.so [.carry/head]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start corrected-scoring "${1:-speed}" "${SCORE_BIN:-.carry/head}"
RESULTS="$OUT"

if [ "$PART" = speed ]; then
  gpu_tests corrected-scoring 240 packages/fpv2-index/tests/test_corrected_scoring.py
  with_packages timeout 300 python3 benchmarks/corrected_scoring_speed.py --shapes 1x32768 1x131072 4x131072 \
    --out "$RESULTS/corrected-scoring-speed.json" > "$LOGS/speed.log" 2>&1
  echo "speed: rc=$?"
  cut -c1-200 "$LOGS/speed.log" | grep -v Warning | tail -40
fi
