#!/usr/bin/env bash
# Device run: where the page-1 pipeline's time goes once the tile repack carries it to the TMA path, from the
# repository root, with the library built on the development machine.
#
#   benchmarks/page1_profile_device_run.sh [all]  the GPU tests of the copy, its policy (vLLM's views through the
#                                      copy included) and the fallback; then benchmarks/pipeline_profile.py (per-kernel
#                                      GPU time under torch.profiler) of the corrected 128K pipeline, B=1, on the
#                                      Hopper backend at page size 1 (repack) and 128 (the caller's pages)
#   benchmarks/page1_profile_device_run.sh sync  the Hopper pipeline's host syncs (the profile counted one per
#                                      corrected call; test_sync_free names the site), the policy's GPU tests, and
#                                      the host time of the memory check before / after one allocator read
#   benchmarks/page1_profile_device_run.sh routing  the routing curves (benchmarks/routing_switch_point.py, 2K-32K) on
#                                      the Hopper backend at page sizes 1 and 16, now through the tile repack
#                                      (the shipped page-1 curve was the gather's); then fpv2 bench at 128K and 32K,
#                                      page 1, with the one-read memory check
#   benchmarks/page1_profile_device_run.sh views  the GPU tests of the policy, the fallback and the transformers
#                                      adapter (head-major K/V now reach the kernel through the copy at every page
#                                      size), then benchmarks/transformers_long_prefill.py at 32K and 64K with
#                                      FPV2_HOPPER_REPACK=auto (Hopper through the copy) and =0 (Triton, as before).
#                                      Prediction: the attention part of the fpv2 forward about 1.7x faster (the
#                                      vLLM views' 128K ratio), the whole 2-layer forward less (projections, MLP).
#                                      (Its first run, at f88cd78, failed in both modes: pooling under
#                                      torch.inference_mode; the serving and index GPU tests of that fix run here.)
#   benchmarks/page1_profile_device_run.sh host  pipeline_profile.py --marks-only and --host-breakdown of the corrected
#                                      pipeline at page 1, 128K and 32K: where the eager time's host part goes
#                                      (eager 14.35 against 13.48 ms host-ahead at 128K)
#   benchmarks/page1_profile_device_run.sh hostfix  after the tile batch is kept on its batch and the memory check reads
#                                      the driver first: the GPU tests of the copy, policy, fallback and the Hopper
#                                      no-sync test, benchmarks/repack_host_probe.py, fpv2 bench at 32K and 128K,
#                                      page 1. Prediction: about 0.1 ms less eager time at 32K (the attention launch
#                                      waited 0.26 ms for the host there), none at 128K (the host is ahead there)
#   benchmarks/page1_profile_device_run.sh relaunch  the copy launched through the Relauncher (moved into the kernel
#                                      wheel): the GPU tests of the copy, the relauncher's index users and the
#                                      Hopper no-sync test, then benchmarks/repack_host_probe.py. Prediction:
#                                      repack_to_tile_pages 72 -> 30-40 us of host time
#   benchmarks/page1_profile_device_run.sh chunks  benchmarks/short_chunk_copy.py: chunks of 512-4096 queries after
#                                      128K keys; page 1, copy against the gather; vLLM views, copy + Hopper against
#                                      Triton. Prediction: against the gather the copy (0.34 ms) stops paying
#                                      between 1K and 4K queries (the 4K chunk gained 0.55-0.75 ms on 2026-12-03);
#                                      against Triton (1.75x slower at 128K) it pays at every chunk size tried
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

if [ "$PART" = routing ]; then
  # Prediction: the copy moves the page-1 sparse curve down at 16K-32K (32K 3.26 -> ~2.2 ms, the bench's figure)
  # and the dense curve (its own dense mode, also copied) 18.7 -> ~12.5 ms at 32K; the switch point stays near 9K.
  with_packages timeout 300 python3 benchmarks/routing_switch_point.py --backend hopper --page-sizes 1 16 \
    --out "$RESULTS/routing-repack" > "$LOGS/routing.log" 2>&1
  echo "routing: rc=$?"
  tail -8 "$LOGS/routing.log" | cut -c1-200
  for L in 131072 32768; do
    bench_row 1 "$L" "bench-page1-$L" 100 --page-size 1 --backend hopper
  done
  (cd "$RESULTS" && tar czf bench-page1.tgz bench-page1-* && rm -rf bench-page1-*)
  exit 0
fi
if [ "$PART" = relaunch ]; then
  gpu_tests relaunch 200 packages/fpv2-kernel/tests/test_tile_repack.py packages/fpv2-kernel/tests/test_triton_relaunch.py \
    packages/fpv2-index/tests/test_triton_host_path.py \
    "packages/fpv2-serving/tests/test_sync_free.py::test_hopper_pipeline_makes_no_host_sync"
  with_packages timeout 100 python3 benchmarks/repack_host_probe.py 2>&1 | tee "$RESULTS/repack-host-probe.txt" | head -11
  exit 0
fi
if [ "$PART" = hostfix ]; then
  gpu_tests hostfix 200 packages/fpv2-kernel/tests/test_tile_repack.py packages/fpv2-serving/tests/test_tile_repack_policy.py \
    packages/fpv2-serving/tests/test_fallback_backend.py \
    "packages/fpv2-serving/tests/test_sync_free.py::test_hopper_pipeline_makes_no_host_sync"
  with_packages timeout 100 python3 benchmarks/repack_host_probe.py 2>&1 | tee "$RESULTS/repack-host-probe.txt" | head -11
  for L in 32768 131072; do
    bench_row 1 "$L" "bench-page1-$L-hostfix" 100 --page-size 1 --backend hopper
  done
  (cd "$RESULTS" && tar czf bench-hostfix.tgz bench-page1-* && rm -rf bench-page1-*)
  exit 0
fi
if [ "$PART" = host ]; then
  for mode in marks-only host-breakdown; do
    with_packages timeout 150 python3 benchmarks/pipeline_profile.py --seqlen 131072 32768 --page-size 1 \
      --backend hopper --"$mode" --out "$RESULTS/host-$mode" > "$LOGS/host-$mode.log" 2>&1
    echo "profile --$mode: rc=$?"
    grep -v "^ *$" "$LOGS/host-$mode.log" | grep -v Warning | cut -c1-150 | head -70
  done
  exit 0
fi
if [ "$PART" = chunks ]; then
  with_packages timeout 300 python3 benchmarks/short_chunk_copy.py --seqlen 131072 --chunks 512 1024 2048 4096 \
    --out "$RESULTS/short-chunks.json" > "$LOGS/short-chunks.log" 2>&1
  echo "short chunks: rc=$?"
  cut -c1-300 "$LOGS/short-chunks.log" | tail -10
  exit 0
fi
if [ "$PART" = views ]; then
  gpu_tests views 240 packages/fpv2-serving/tests/test_tile_repack_policy.py packages/fpv2-serving/tests/test_fallback_backend.py \
    packages/fpv2-serving/tests/test_adapter_transformers.py packages/fpv2-serving/tests/test_serving_gpu.py \
    packages/fpv2-index/tests/test_triton_pooled_copies.py
  for mode in auto 0; do
    FPV2_HOPPER_REPACK=$mode with_packages timeout 150 python3 benchmarks/transformers_long_prefill.py \
      --seqlens 32768 65536 --no-dense-reference --out "$RESULTS/transformers-repack-$mode" \
      > "$LOGS/transformers-$mode.log" 2>&1
    echo "transformers FPV2_HOPPER_REPACK=$mode: rc=$?"
    grep -E "^\|" "$LOGS/transformers-$mode.log" | cut -c1-260 | head -8
  done
  exit 0
fi
if [ "$PART" = sync ]; then
  gpu_tests sync 200 -x "packages/fpv2-serving/tests/test_sync_free.py::test_hopper_pipeline_makes_no_host_sync" \
    packages/fpv2-serving/tests/test_tile_repack_policy.py
  with_packages python3 -c '
import timeit, torch
from fpv2.serving.tile_repack_policy import repack_headroom_bytes
d = torch.device("cuda", 0); torch.empty(1, device=d)
old = lambda: torch.cuda.mem_get_info(d)[0] + torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d)
for name, fn in (("two memory_stats", old), ("one nested dict", lambda: repack_headroom_bytes(d))):
    print(f"headroom via {name}: {min(timeit.repeat(fn, number=200, repeat=5)) / 200 * 1e6:.1f} us a call")
' 2>&1 | tee "$LOGS/headroom-host.txt"
  exit 0
fi

gpu_tests repack 200 packages/fpv2-kernel/tests/test_tile_repack.py packages/fpv2-serving/tests/test_tile_repack_policy.py \
  packages/fpv2-serving/tests/test_fallback_backend.py
for page in 1 128; do
  with_packages timeout 150 python3 benchmarks/pipeline_profile.py --seqlen 131072 --page-size "$page" \
    --backend hopper --out "$RESULTS/profile-page$page" > "$LOGS/profile-page$page.log" 2>&1
  echo "profile page $page: rc=$?"
  head -45 "$LOGS/profile-page$page.log" | cut -c1-160
done
