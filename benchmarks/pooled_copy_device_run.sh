#!/usr/bin/env bash
# Device run: the tile-page copy written by the pooling kernel (pool_blocks_triton(..., tile_copies=...)) instead of
# the Hopper backend's own copy launch, from the repository root, with the library built on the development machine.
#
#   benchmarks/pooled_copy_device_run.sh [all]  the GPU tests of the copy (index: the tile pages against the repack,
#                                      compiled; serving: the Hopper pipeline on the pooled copy, same bits as its own
#                                      copy, and the existing copy / no-sync suites), then
#                                      benchmarks/pooled_copy_speed.py at 32K, 128K and 4 x 128K (page 1)
#   benchmarks/pooled_copy_device_run.sh bench  fpv2 bench of the corrected planted pipeline at page 1 (Hopper backend):
#                                      128K, 32K and 4 x 128K, the record of the landed state
#   benchmarks/pooled_copy_device_run.sh host  the host breakdown and launch marks of a 128K call (page 1)
#
# Prediction (written before the run): the pooling kernel reads every token of K and V already; writing them into
# the tile pages adds the copy's writes (0.5 GB at 128K) but drops the copy kernel's read and its launch. At 128K,
# page 1: copy kernel 0.267 ms gone, pooling 0.13 -> 0.22-0.27 ms, so -0.10 to -0.15 ms GPU time a call (13.5 ->
# 13.35-13.4 host-ahead); 4 x 128K -0.4 to -0.55 ms; 32K -0.02 to -0.04 ms. Eager: the backend's copy policy now
# runs before the pooling launch (+0.02-0.04 ms host before the first kernel), the copy launch's host time
# (~0.07 ms, hidden behind the scoring) goes. Outputs bit-identical.
#
# Environment: SCORE_BIN folder with libfpv2_kernel.so [.carry/head]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start pooled-copy "${1:-all}" "${SCORE_BIN:-.carry/head}"
RESULTS="$OUT"

if [ "$PART" = all ]; then
  gpu_tests index-copy 300 packages/fpv2-index/tests/test_triton_pooled_tile_copies.py \
    packages/fpv2-index/tests/test_triton_pooled_copies.py packages/fpv2-index/tests/test_corrected_scoring.py
  gpu_tests serving 400 packages/fpv2-serving/tests/test_serving_gpu.py packages/fpv2-serving/tests/test_tile_repack_policy.py \
    packages/fpv2-serving/tests/test_sync_free.py packages/fpv2-serving/tests/test_pooled_tile_copies.py
  with_packages timeout 420 python3 benchmarks/pooled_copy_speed.py --shapes 1x131072 1x32768 4x131072 \
    --out "$RESULTS/pooled-copy-speed.json" > "$LOGS/speed.log" 2>&1
  echo "speed: rc=$?"
  grep -v Warning "$LOGS/speed.log" | cut -c1-220 | tail -20
fi

if [ "$PART" = bench ]; then
  bench_row 1 131072 bench-page1-131072 150 --page-size 1 --backend hopper
  bench_row 1 32768 bench-page1-32768 120 --page-size 1 --backend hopper
  bench_row 4 131072 bench-page1-4x131072 280 --page-size 1 --backend hopper
fi

if [ "$PART" = host ]; then
  # Where the eager call's host time goes now that the backend's copy policy runs before the pooling launch
  # (tile_copies_for). Prediction: tile_copies_for 20-40 us before the pooling launch; the pooling launched at about
  # 0.3 ms into the call (sixteenth session: 0.35 ms).
  host_breakdown_128k host "_tile_copies|tile_copies_for|serves|allocate_tile|pool_blocks_triton|launch_pool|validate"
  with_packages timeout 150 python3 benchmarks/pipeline_profile.py --seqlen 131072 --page-size 1 --backend hopper \
    --marks-only --repeats 30 --out "$RESULTS/marks" > "$RESULTS/marks-131072.txt" 2>&1
  echo "marks: rc=$?"
  grep -v Warning "$RESULTS/marks-131072.txt" | tail -14 | cut -c1-140
fi

if [ "$PART" = verify ]; then
  # After one allocation for both tile-page halves and the copy rule before serves(): the copy's GPU tests, then the
  # host breakdown again. Prediction: _tile_copies 133-177 -> 100-140 us.
  gpu_tests serving 300 packages/fpv2-serving/tests/test_serving_gpu.py packages/fpv2-serving/tests/test_tile_repack_policy.py
  gpu_tests index 200 packages/fpv2-index/tests/test_triton_pooled_tile_copies.py
  host_breakdown_128k host-verify "_tile_copies|tile_copies_for|serves|allocate_tile|launch_pool"
fi

if [ "$PART" = suites ]; then
  # The index and serving packages' GPU suites on the session's end state.
  gpu_tests index-gpu 200 packages/fpv2-index/tests -m "gpu or hopper"
  gpu_tests serving-gpu 160 packages/fpv2-serving/tests -m "gpu or hopper"
fi
