#!/usr/bin/env bash
# Device run: where the page-1 pipeline's time goes once the tile repack carries it to the TMA path, from the
# repository root, with the library built on the development machine.
#
#   benchmarks/page1_profile_device_run.sh [all]  the GPU tests of the copy, its policy (vLLM's views through the
#                                      copy included) and the fallback; then benchmarks/pipeline_profile.py (per-kernel
#                                      GPU time under torch.profiler) of the corrected 128K pipeline, B=1, on the
#                                      Hopper backend at page size 1 (repack) and 128 (the caller's pages)
#
# Question (written before the run): the page-1 pipeline is 13.3 GPU ms at 128K against about 12.7 for vLLM's views
# at block size 16 through the same copy (2026-12-04). Expected: the attention kernel is the same (tile pages in
# both), the copy the same 0.34 ms, so the difference is the index stage's pooling, which gathers page-1 rows;
# if pooling at page 1 costs 0.4-0.6 ms more than at page 128, pooling from the tile copy (copy first) pays.
#
# Environment: REPACK_BIN folder with libfpv2_kernel.so [.carry/head]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start page1-profile "${1:-all}" "${REPACK_BIN:-.carry/head}"
RESULTS="$OUT"

with_packages timeout 200 python3 -m pytest -p no:cacheprovider -q packages/fpv2-kernel/tests/test_tile_repack.py \
  packages/fpv2-serving/tests/test_tile_repack_policy.py packages/fpv2-serving/tests/test_fallback_backend.py \
  > "$LOGS/pytest-repack.log" 2>&1
echo "GPU tests: rc=$? $(tail -1 "$LOGS/pytest-repack.log")"
grep -E "^FAILED" "$LOGS/pytest-repack.log" | head -20
for page in 1 128; do
  with_packages timeout 150 python3 benchmarks/pipeline_profile.py --seqlen 131072 --page-size "$page" \
    --backend hopper --out "$RESULTS/profile-page$page" > "$LOGS/profile-page$page.log" 2>&1
  echo "profile page $page: rc=$?"
  head -45 "$LOGS/profile-page$page.log" | cut -c1-160
done
