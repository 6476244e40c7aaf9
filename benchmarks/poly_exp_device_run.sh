#!/usr/bin/env bash
# Device run: part of the exponentials on the FMA pipe (hopper/poly_exp2.hpp) instead of the multi-function unit,
# in the index's scoring kernel and in the attention kernel's softmax, from the repository root. The switches and
# the polynomial are in results/2026-12-05-h100-poly-exp/poly-exp.patch (measured slower, reverted): build the
# libraries from a tree with the patch applied.
#
#   benchmarks/poly_exp_device_run.sh ab   the scoring kernel with FPV2_SCORE_POLY_EXP = 0, 2, 3, 4 (of every 8
#                                          logits of an unmasked step) at 128K, 32K and 4 x 128K in one process, the
#                                          scoring GPU tests at 2 and 3; then the attention kernel alone
#                                          (attention_switch_probe.py, planted 128K and 32K, off and mean) for the
#                                          libraries built with FPV2_HOPPER_POLY_EXP_COLUMNS = 0 (BIN), 2 (POLY2_BIN)
#                                          and 3 (POLY3_BIN) in alternating processes
#   benchmarks/poly_exp_device_run.sh tests  the Hopper kernel's GPU tests on TEST_BIN [POLY2_BIN]
#
# Prediction (written before the run). The SASS of the scoring step (unmasked, per thread): 202 instructions and 64
# MUFU.EX2 shipped; 2 of 8 -> ~330 and 48; 3 of 8 -> 395 and 40 (8 instructions per polynomial exponential). A
# warp's MUFU op holds its scheduler's MUFU for 8 cycles, so the exponential phase is MUFU-bound at 512 cycles a
# warp-step shipped, ~384 (MUFU) against ~330 (issue) at 2 of 8, and issue-bound at ~395 at 3 of 8. If the
# product and the exponentials keep running one after the other (ncu: tensor 42% + XU 44%), the step's ~1280
# cycles lose 100-130: the scoring kernel 5-12% faster at 2 or 3 of 8 (1.41 -> 1.25-1.34 ms at 128K on an H100),
# 4 of 8 no better than 3; differing index pairs within the tests' rounding allowance (the polynomial's relative
# error is 7.5e-5). The attention softmax at d = 128 is MUFU-bound the same way (64 exponentials a thread a block,
# ~250 other instructions): if its phase also runs apart from the products, 2 of 8 cuts the attention kernel by
# 3-8% at 128K (11.4 -> 10.5-11.1 ms on the H200); if the phases already overlap, both changes are within 2% or
# slower.
#
# Environment: BIN, POLY2_BIN, POLY3_BIN folders with libfpv2_kernel.so [.carry/head, .carry/poly2, .carry/poly3];
# OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start poly-exp "${1:-ab}" "${BIN:-.carry/head}"
RESULTS="$OUT"
POLY2_BIN="${POLY2_BIN:-.carry/poly2}"
POLY3_BIN="${POLY3_BIN:-.carry/poly3}"

if [ "$PART" = ab ]; then
  with_packages timeout 150 python3 benchmarks/scoring_switch_probe.py --env FPV2_SCORE_POLY_EXP --settings 0,2,3,4 \
    --shapes 1x131072 1x32768 4x131072 --label head --out "$RESULTS/scoring-poly.jsonl" > "$LOGS/scoring.log" 2>&1
  echo "scoring probe: rc=$?"
  cut -c1-600 "$RESULTS/scoring-poly.jsonl"
  tail -3 "$LOGS/scoring.log" | cut -c1-300
  for columns in 2 3; do
    FPV2_SCORE_POLY_EXP=$columns gpu_tests "scoring-poly$columns" 90 packages/fpv2-index/tests/test_hopper_scoring.py -m gpu
  done
  attention_rounds 2 off,mean attention-poly.jsonl "head=$BIN" "poly2=$POLY2_BIN" "poly3=$POLY3_BIN"
  attention_table attention-poly.jsonl
fi

if [ "$PART" = tests ]; then
  # The Hopper kernel's GPU suite on the library named by TEST_BIN (the winning attention variant).
  BIN="${TEST_BIN:-$POLY2_BIN}" gpu_tests hopper-kernel 300 packages/fpv2-kernel/tests/test_hopper_kernel.py -m hopper
fi
