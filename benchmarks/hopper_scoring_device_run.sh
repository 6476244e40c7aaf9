#!/usr/bin/env bash
# Device run: the index's scoring on Hopper's tensor cores (fpv2_score_blocks, ABI 1.4) against the fused Triton
# pass, from the repository root, with the library built on the development machine.
#
#   benchmarks/hopper_scoring_device_run.sh [all]  the GPU tests of the new kernel (tests/test_hopper_scoring.py:
#                                      the grid against the reference and the Triton pass, stale workspace bits, no
#                                      host sync), the Triton index GPU tests (which now take the Hopper kernel where
#                                      it serves, FPV2_INDEX_SCORING=auto at the first run) and the kernel package's native ABI tests;
#                                      then benchmarks/hopper_scoring_speed.py at 32K, 128K and 4 x 128K
#   benchmarks/hopper_scoring_device_run.sh final  the landed kernel's GPU tests (the Triton index suite with
#                                      FPV2_INDEX_SCORING=auto too), the speed table, fpv2 bench on vLLM's NHD views
#                                      and at d = 64 / 256 through the copy (page 1)
#   (the A/B of two kernel variants and its ncu ran as part "ab" at commit 415bd16: results/2026-12-04-h200-hopper-scoring/)
#   (the zero-offset A/B ran as part "offset" at commit b39b81a, with experiments/score-zero-offset.patch applied:
#   results/2026-12-06-h100-softmax-ab/offset/; landed for bf16 at d = 128)
#   benchmarks/hopper_scoring_device_run.sh lines  ncu's source counters of the scoring kernel at 128K (instructions
#                                      and stall samples per line), as CSV
#   benchmarks/hopper_scoring_device_run.sh pipes  ncu's pipe utilisations of the scoring kernel at 128K and the
#                                      host breakdown of a corrected pipeline call (prediction in the part)
#   benchmarks/hopper_scoring_device_run.sh bench  fpv2 bench of the corrected planted pipeline at page 1 (Hopper
#                                      backend), 128K, 32K and 4 x 128K, with the Hopper scoring (auto) and the
#                                      Triton pass (FPV2_INDEX_SCORING=triton)
#
# Prediction (written before the run): the Triton pass runs at about half its tensor / MUFU bound (1.59 ms at 128K
# against 0.55-0.83). One warpgroup per (tile, KV head), the product of step n+1 issued before step n's
# exponentials, two CTAs per SM: scoring 1.59 -> 0.9-1.1 ms at 128K (-0.5 to -0.7 ms), 32K 0.20 -> 0.12-0.15 ms,
# 4 x 128K 6.4 -> 3.6-4.4 ms; the same index up to blocks within rounding of alpha.
#
# Environment: SCORE_BIN folder with libfpv2_kernel.so [.carry/head]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start hopper-scoring "${1:-all}" "${SCORE_BIN:-.carry/head}"
RESULTS="$OUT"

# benchmarks/hopper_scoring_speed.py at 32K, 128K and 4 x 128K into $RESULTS/hopper-scoring-speed-NAME.json, its
# one-line summaries printed: speed_table NAME
speed_table() {
  with_packages timeout 240 python3 benchmarks/hopper_scoring_speed.py --shapes 1x32768 1x131072 4x131072 \
    --out "$RESULTS/hopper-scoring-speed-$1.json" > "$LOGS/speed-$1.log" 2>&1
  echo "speed $1: rc=$?"
  grep -E "^[0-9]+ x " "$LOGS/speed-$1.log" | cut -c1-400
}

if [ "$PART" = all ]; then
  nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
  gpu_tests scoring 240 packages/fpv2-index/tests/test_hopper_scoring.py -s
  gpu_tests index 300 packages/fpv2-index/tests/test_triton_index.py packages/fpv2-index/tests/test_index_api.py \
    -m gpu
  gpu_tests native 120 packages/fpv2-kernel/tests/test_native_abi.py
  speed_table first
fi

if [ "$PART" = final ]; then
  # The landed kernel (one accumulator, three CTAs per SM): its tests, the Triton index GPU suite with the kernel
  # taking every call it serves (FPV2_INDEX_SCORING=auto), the native ABI tests, the speed table; then the Next
  # list's unmeasured rows: fpv2 bench on vLLM's token-major (NHD) views, and d = 64 / 256 through the copy.
  gpu_tests scoring 240 packages/fpv2-index/tests/test_hopper_scoring.py
  FPV2_INDEX_SCORING=auto gpu_tests index-auto 300 packages/fpv2-index/tests/test_triton_index.py \
    packages/fpv2-index/tests/test_index_api.py packages/fpv2-index/tests/test_triton_index_variants.py -m gpu
  gpu_tests native 120 packages/fpv2-kernel/tests/test_native_abi.py packages/fpv2-kernel/tests/test_native_score_abi.py
  speed_table final
  for L in 131072 32768; do
    bench_row 1 "$L" "bench-vllm-nhd-$L" 120 --page-size 16 --cache-layout vllm --backend hopper
  done
  for D in 64 256; do
    bench_row 1 32768 "bench-page1-d$D" 120 --page-size 1 --head-dim "$D" --backend hopper
  done
fi

if [ "$PART" = persist ]; then
  # Persistent CTAs (the next tile located and its first loads issued under the last step's exponentials and
  # the selection). Prediction: the per-tile fixed cost (about 7 us per tile and slot, fitted from the 32K and
  # 128K times of the one-CTA-per-tile kernel) drops to 3-4 us: 1.90 -> 1.55-1.65 ms at 128K, 0.23 -> 0.18-0.20 at
  # 32K. Then ncu's stall reasons of the persistent kernel at 128K.
  gpu_tests scoring 240 packages/fpv2-index/tests/test_hopper_scoring.py
  FPV2_INDEX_SCORING=auto gpu_tests index-auto 300 packages/fpv2-index/tests/test_triton_index.py \
    packages/fpv2-index/tests/test_index_api.py -m gpu
  speed_table persistent
  FPV2_INDEX_SCORING=hopper with_packages timeout 200 ncu --kernel-name-base demangled \
    --kernel-name regex:index::score_select --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 benchmarks/hopper_scoring_speed.py --shapes 1x131072 --repeats 2 --no-kernel-times \
    --out "$LOGS/ncu-run.json" > "$RESULTS/ncu-persistent.txt" 2>&1
  echo "ncu: rc=$?"
  grep -E "Duration|Compute \(SM\)|issue_stalled" "$RESULTS/ncu-persistent.txt" | sort -k3 -n -r | head -24 | cut -c1-140
fi

if [ "$PART" = last ]; then
  # The landed kernel (persistent CTAs, the two keys side by side; the FPV2_SCORE_POLY knob of part "ilp" at
  # dcf6a91 measured slower and was removed): its tests and the native ABI tests, then fpv2 bench on vLLM's
  # token-major (NHD) views at 128K and 32K (part "final" lost their JSON to the transfer's file count: packed).
  gpu_tests scoring 240 packages/fpv2-index/tests/test_hopper_scoring.py
  gpu_tests native 120 packages/fpv2-kernel/tests/test_native_abi.py packages/fpv2-kernel/tests/test_native_score_abi.py
  for L in 131072 32768; do
    bench_row 1 "$L" "bench-vllm-nhd-$L" 120 --page-size 16 --cache-layout vllm --backend hopper
  done
  (cd "$RESULTS" && tar czf bench-vllm-nhd.tgz bench-vllm-nhd-* && rm -rf bench-vllm-nhd-*)
fi

if [ "$PART" = copies ] || [ "$PART" = query ]; then
  # The key copies from one shared-memory base per thread and fixed pass / buffer offsets (the SASS census of the
  # step loop: the copy's address arithmetic was about 150 of the step's instructions). Prediction: 1.84 -> 1.6-1.7 ms.
  gpu_tests scoring 240 packages/fpv2-index/tests/test_hopper_scoring.py
  speed_table "$PART"
fi

# compute-sanitizer memcheck and racecheck of the scoring kernels (benchmarks/hopper_scoring_sanitize.py: two
# requests with a prefix), their summaries printed: sanitize_scoring
sanitize_scoring() {
  for tool in memcheck racecheck; do
    with_packages timeout 150 compute-sanitizer --tool "$tool" --kernel-name kns=score \
      python3 benchmarks/hopper_scoring_sanitize.py > "$RESULTS/sanitizer-$tool.txt" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|scored" "$RESULTS/sanitizer-$tool.txt" | tr '\n' ' ')"
  done
}

# The scoring kernel's GPU tests, the speed table NAME and the sanitizers: scoring_checks NAME
scoring_checks() {
  gpu_tests scoring 240 packages/fpv2-index/tests/test_hopper_scoring.py
  speed_table "$1"
  sanitize_scoring
}

if [ "$PART" = review ]; then
  # After the review mends (one launch-preparation cache per device; the index's Hopper branch no longer sizes the
  # Triton grid): the tests, the speed table, and compute-sanitizer memcheck and racecheck of the scoring kernels.
  gpu_tests scoring 240 packages/fpv2-index/tests/test_hopper_scoring.py
  gpu_tests native 120 packages/fpv2-kernel/tests/test_native_abi.py packages/fpv2-kernel/tests/test_native_score_abi.py
  speed_table review
  sanitize_scoring
fi

if [ "$PART" = shift ]; then
  # Unmasked steps after a tile's first take the thread's running maximum as every key's offset (no maximum
  # tree and quad exchange before the exponentials; 306 -> 238 instructions in the step's reduction, about
  # 500 -> 430 a step with the copies and the product). Prediction: 128K 1.55 -> 1.35-1.45 ms, 32K 0.171 ->
  # 0.150-0.160, 4 x 128K 6.2 -> 5.4-5.8; 0 differing pairs. Then compute-sanitizer on the new path.
  # (Measured at 7b8d2ff: 1.474 ms, 0.167, 5.97: -5%, under the prediction.)
  scoring_checks shift
fi

if [ "$PART" = unchecked ]; then
  # Steps whose 64 keys are all candidates copy them with no bounds predicate and one 64-bit add a row (the
  # SASS: 8 copies from ~112 to ~55 instructions a step). Prediction: 128K 1.474 -> 1.40-1.44 ms, 4 x 128K
  # 5.97 -> 5.7-5.85; 0 differing pairs; sanitizers clean.
  scoring_checks unchecked
fi

if [ "$PART" = sampled ]; then
  # Cheap offsets on every step: a tile's first step takes the quad's largest first / last logit of each key as
  # its offset, and the masked last step too (per-logit masks only for the one key a row may not see, or a
  # tile of fewer than 128 rows). At 32K a tile has about two steps, both of which ran the exact path.
  # Prediction: 32K 0.164 -> 0.135-0.150 ms, 128K 1.440 -> 1.37-1.42, 4 x 128K 5.88 -> 5.6-5.8; 0 differing
  # pairs; sanitizers clean.
  FPV2_INDEX_SCORING=auto gpu_tests index-auto 300 packages/fpv2-index/tests/test_triton_index.py \
    packages/fpv2-index/tests/test_index_api.py packages/fpv2-index/tests/test_triton_index_variants.py -m gpu
  scoring_checks sampled
fi

if [ "$PART" = pipeline ]; then
  # The corrected pipeline (Hopper backend, page 1) with each scoring pass, alternating in one process
  # (hopper_scoring_speed.py --pipeline), then fpv2 bench with the Hopper scoring at 128K and 4 x 128K. Prediction
  # (the kernel 95 us faster at 128K, 420 us at 4 x 128K, plus the 17 / 65 us prefix-sum launch): 128K -0.05 to
  # -0.1 ms, 4 x 128K -0.3 to -0.4 ms, 32K within +-0.02 ms.
  gpu_tests native 120 packages/fpv2-kernel/tests/test_native_score_abi.py
  with_packages timeout 300 python3 benchmarks/hopper_scoring_speed.py --pipeline \
    --shapes 1x32768 1x131072 4x131072 --out "$RESULTS/hopper-scoring-pipeline.json" > "$LOGS/pipeline.log" 2>&1
  echo "pipeline: rc=$?"
  grep -E "^[0-9]+ x " "$LOGS/pipeline.log" | cut -c1-300
  FPV2_INDEX_SCORING=auto bench_row 1 131072 bench-auto-131072 120 --page-size 1 --backend hopper
  FPV2_INDEX_SCORING=auto bench_row 4 131072 bench-auto-4x131072 150 --page-size 1 --backend hopper
fi

if [ "$PART" = host ]; then
  # Why the pipeline A/B of part "pipeline" showed no gain from a scoring kernel 95 us faster at 128K: the host's
  # launch marks and per-function host time of a corrected call (page 1, Hopper backend) with each scoring pass.
  # Expected: the scoring launch is on the critical path (session 16: GPU idle ~0.18 ms before it), and the
  # Hopper path's host work before its launch (the mode checks, the argument struct: ~27 us of Python on the
  # development machine) is longer than the Triton pass's relaunch.
  for mode in triton auto; do
    FPV2_INDEX_SCORING=$mode with_packages timeout 200 python3 benchmarks/pipeline_profile.py --seqlen 32768 131072 \
      --page-size 1 --backend hopper --marks-only --out "$RESULTS/marks-$mode" > "$RESULTS/marks-$mode.txt" 2>&1
    echo "marks $mode: rc=$?"
    FPV2_INDEX_SCORING=$mode with_packages timeout 200 python3 benchmarks/pipeline_profile.py --seqlen 32768 131072 \
      --page-size 1 --backend hopper --host-breakdown --out "$RESULTS/host-$mode" > "$RESULTS/host-$mode.txt" 2>&1
    echo "host breakdown $mode: rc=$?"
  done
  grep -A8 "corrected, waited by synchronize" "$RESULTS"/marks-*.txt | cut -c1-120
  grep -E "==|whole call|pool_blocks_triton|select_blocks_triton|_launch_|score_|use_hopper|HopperBackend.run " \
    "$RESULTS"/host-*.txt | cut -c1-130
fi

if [ "$PART" = lines ]; then
  # Where the scoring kernel's instructions go at 128K: ncu's source counters (instructions executed and stall
  # samples per CUDA line and per SASS instruction) of one launch, as CSV for the development machine.
  # Prediction (27th session): the static count of a step's loop is ~300 warp instructions (the unmasked
  # reduce_shifted block 202), against ~556 a warp-step from last session's issue activity (44.7% of ~1245 SM
  # cycles a step): either the masked last steps and the exact-offset redo (reduce) run far more often than
  # assumed, or the per-tile work (locate, select, the first loads) is a large share. Reading the CSV decides.
  FPV2_INDEX_SCORING=hopper with_packages timeout 240 ncu --kernel-name-base demangled \
    --kernel-name regex:index::score_select --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --section LaunchStats --import-source yes \
    --metrics smsp__inst_executed.sum,sm__cycles_elapsed.avg,smsp__issue_active.avg.pct_of_peak_sustained_elapsed \
    --export "$LOGS/scoring-lines" \
    python3 benchmarks/hopper_scoring_speed.py --shapes 1x131072 --repeats 2 --no-kernel-times \
    --out "$LOGS/ncu-run.json" > "$RESULTS/ncu-lines.txt" 2>&1
  echo "ncu: rc=$?"
  grep -E "inst_executed|cycles_elapsed|issue_active|Duration" "$RESULTS/ncu-lines.txt" | cut -c1-140
  ncu --import "$LOGS/scoring-lines.ncu-rep" --page source --csv --print-source cuda,sass \
    > "$RESULTS/scoring-source-cuda.csv" 2> "$LOGS/source.err"
  echo "source page: rc=$? $(wc -l < "$RESULTS/scoring-source-cuda.csv") lines"
  python3 scripts/ncu_lines.py "$RESULTS/scoring-source-cuda.csv" --column "Instructions Executed" --count 20
  python3 scripts/ncu_lines.py "$RESULTS/scoring-source-cuda.csv" --count 20
  ncu --import "$LOGS/scoring-lines.ncu-rep" --page source --csv --print-source sass \
    > "$RESULTS/scoring-source-sass.csv" 2>> "$LOGS/source.err"
  echo "sass page: rc=$? $(wc -l < "$RESULTS/scoring-source-sass.csv") lines"
  gzip -f "$RESULTS/scoring-source-cuda.csv" "$RESULTS/scoring-source-sass.csv"
fi

if [ "$PART" = pipes ]; then
  # What bounds the scoring kernel at 128K (1.45 ms; its step costs ~1280 SM cycles against 512 for the product and
  # 512 for the exponentials): ncu's pipe utilisations, shared-memory wavefronts, issue activity and stalls of one
  # launch, then the host breakdown of a corrected pipeline call at 128K and 32K (page 1, Hopper backend).
  # Prediction (26th session): tensor (gmma) pipe and XU (MUFU) each active 35-45% of the elapsed cycles, their sum
  # at most ~100% (the CTAs' product and exponential phases do not overlap), shared-memory wavefronts ~40%, issue
  # active ~50%. If the sum is well above 100% the phases already overlap and issue latency is the bound.
  PIPES="sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"
  PIPES+=",sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_elapsed"
  PIPES+=",sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed"
  PIPES+=",sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed"
  PIPES+=",sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_elapsed"
  PIPES+=",l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed"
  PIPES+=",smsp__issue_active.avg.pct_of_peak_sustained_elapsed"
  PIPES+=",smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active"
  FPV2_INDEX_SCORING=hopper with_packages timeout 200 ncu --kernel-name-base demangled \
    --kernel-name regex:index::score_select --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --metrics "$PIPES,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 benchmarks/hopper_scoring_speed.py --shapes 1x131072 --repeats 2 --no-kernel-times \
    --out "$LOGS/ncu-run.json" > "$RESULTS/ncu-pipes.txt" 2>&1
  echo "ncu: rc=$?"
  grep -E "Duration|pct_of_peak|per_cycle_active" "$RESULTS/ncu-pipes.txt" | cut -c1-140
  grep -E "issue_stalled" "$RESULTS/ncu-pipes.txt" | sort -k3 -n -r | head -8 | cut -c1-140
  with_packages timeout 200 python3 benchmarks/pipeline_profile.py --seqlen 131072 32768 --page-size 1 \
    --backend hopper --host-breakdown --repeats 30 --out "$RESULTS/host" > "$RESULTS/host.txt" 2>&1
  echo "host breakdown: rc=$?"
  grep -E "==|whole call|validate|StageClock|_pool_statistics|pool_blocks_triton|launch_pool|fresh_outputs|tile_copies|select_blocks|HopperBackend.run |hopper_prefill" \
    "$RESULTS/host.txt" | cut -c1-120
fi

if [ "$PART" = default ]; then
  # The Hopper scoring as the default (FPV2_INDEX_SCORING unset): its tests (the default's dispatch included), the
  # index package's GPU suites (their Triton-pass modules pinned to the Triton pass by tests/conftest.py, the API
  # tests on the default) and the serving pipeline's GPU tests.
  gpu_tests scoring 240 packages/fpv2-index/tests/test_hopper_scoring.py
  gpu_tests index 300 packages/fpv2-index/tests/test_index_api.py packages/fpv2-index/tests/test_triton_index.py \
    packages/fpv2-index/tests/test_triton_host_path.py packages/fpv2-index/tests/test_index_workspace_streams.py \
    packages/fpv2-index/tests/test_triton_index_variants.py -m gpu
  gpu_tests serving 240 packages/fpv2-serving/tests/test_serving_pipeline.py -m gpu
fi

if [ "$PART" = serving ]; then
  # Part "default" picked a serving file without GPU tests: the serving GPU suites on the new default (the soak
  # tests left out), the sync-free checks included.
  gpu_tests serving 400 packages/fpv2-serving/tests/test_serving_gpu.py packages/fpv2-serving/tests/test_sync_free.py \
    packages/fpv2-serving/tests/test_chunked_prefill.py packages/fpv2-serving/tests/test_adapter_vllm.py \
    packages/fpv2-serving/tests/test_tile_repack_policy.py packages/fpv2-serving/tests/test_adapter_transformers.py -m gpu
fi

if [ "$PART" = refactor ]; then
  # The step's key selection and masks in one helper for both reductions (the exact path no longer sets the
  # logits of keys past the candidates to -inf: their energies are never stored): the tests, the speed table
  # (expected unchanged) and the sanitizers; then where the host time of an eager call goes (cProfile of the
  # corrected 128K page-1 call, no torch.profiler in the process: launch_pool costs 159 us there).
  scoring_checks refactor
  with_packages timeout 150 python3 benchmarks/pipeline_profile.py --seqlen 131072 --page-size 1 --backend hopper \
    --cprofile --out "$RESULTS/cprofile" > "$RESULTS/cprofile-131072.txt" 2>&1
  echo "cprofile: rc=$?"
  grep -E "==|launch_pool|fresh_outputs|relaunch|_POOL|pooling.py|pool_blocks" "$RESULTS/cprofile-131072.txt" | head -30 | cut -c1-150
fi

if [ "$PART" = pool-host ]; then
  # Where launch_pool's host time goes inside the pipeline: cProfile of 50 corrected 128K page-1 calls, with the
  # callees of the pooling launch, of fresh_outputs and of the relaunches.
  with_packages timeout 150 python3 benchmarks/pipeline_profile.py --seqlen 131072 --page-size 1 --backend hopper \
    --cprofile --repeats 50 --out "$RESULTS/cprofile" > "$RESULTS/cprofile-pool-131072.txt" 2>&1
  echo "cprofile: rc=$?"
  grep -E "==|launch_pool|pool_blocks_triton|fresh_outputs|relaunch.py|_carve|torch.empty|launcher" \
    "$RESULTS/cprofile-pool-131072.txt" | head -40 | cut -c1-160
fi

if [ "$PART" = carve ]; then
  # The carve layout memoised per part list (the pooling's seven outputs: fresh_outputs was about half of
  # launch_pool's host time under cProfile). Prediction: fresh_outputs -10 to -20 us a call, launch_pool likewise.
  # (Ran as "host" into host-carve-131072.txt; now host-carve/ and host-carve-131072.txt.)
  host_breakdown_128k host-carve "pool_blocks_triton|launch_pool|fresh_outputs|select_blocks_triton|_launch_hopper"
fi

if [ "$PART" = bench ]; then
  for mode in auto triton; do
    for L in 131072 32768; do
      FPV2_INDEX_SCORING=$mode bench_row 1 "$L" "bench-$mode-$L" 120 --page-size 1 --backend hopper
    done
    FPV2_INDEX_SCORING=$mode bench_row 4 131072 "bench-$mode-4x131072" 150 --page-size 1 --backend hopper
  done
fi
