#!/usr/bin/env bash
# Device run of the tile repack issued on a side stream under the index stage (fpv2.serving.tile_repack_staging),
# and of vLLM's K/V views served by the Hopper kernel through the copy, from the repository root, with the library
# built on the development machine.
#
#   benchmarks/repack_overlap_device_run.sh [all]  the GPU tests of the copy, its staging, policy and the fallback;
#                                        benchmarks/repack_overlap_speed.py (side stream on / off at page 1, 32K and
#                                        128K B=1, 128K B=4; vLLM views at block size 16, Triton against copy +
#                                        Hopper, 32K and 128K); fpv2 bench rows at 128K and 32K, page 1
#   benchmarks/repack_overlap_device_run.sh batch  the fpv2 bench row 4 x 128K at page 1
#
# Prediction (written before the run): the copy (0.34 ms at 128K, 0.14 at 32K) runs beside the scoring pass, which
# is compute-bound, so 0.25-0.34 ms of it leaves the 128K pipeline (eager 14.3 -> 14.0-14.1 ms, host-ahead 13.3 ->
# 13.0-13.1), 0.08-0.14 ms at 32K and 1.0-1.3 ms at 4 x 128K (57.4 -> 56.1-56.4). vLLM's views at block size 16 went
# to the Triton kernel (about 24 ms at 128K); through the copy the Hopper kernel's page-1 figure applies, about 14.3
# ms: 1.5-1.7x faster.
#
# Environment: REPACK_BIN folder with libfpv2_kernel.so [.carry/head]; FPV2_COMMIT (recorded by fpv2 bench); OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start repack-overlap "${1:-all}" "${REPACK_BIN:-.carry/head}"
RESULTS="$OUT"

if [ "$PART" = batch ]; then
  bench_row 4 131072 bench-page1-4x131072-overlap 280 --page-size 1 --backend hopper
  (cd "$RESULTS" && tar czf overlap-bench-batch.tgz bench-page1-* && rm -rf bench-page1-*)
  exit 0
fi
with_packages timeout 200 python3 -m pytest -p no:cacheprovider -q packages/fpv2-kernel/tests/test_tile_repack.py \
  packages/fpv2-serving/tests/test_tile_repack_staging.py packages/fpv2-serving/tests/test_tile_repack_policy.py \
  packages/fpv2-serving/tests/test_fallback_backend.py > "$LOGS/pytest-overlap.log" 2>&1
echo "GPU tests: rc=$? $(tail -1 "$LOGS/pytest-overlap.log")"
grep -E "FAILED|Error" "$LOGS/pytest-overlap.log" | head -20
with_packages timeout 240 python3 benchmarks/repack_overlap_speed.py --lengths 32768 131072 --batches 1 4 \
  --vllm-lengths 32768 131072 --out "$RESULTS/overlap-speed.json" > "$LOGS/overlap-speed.log" 2>&1
echo "overlap speed: rc=$?"
cut -c1-400 "$LOGS/overlap-speed.log" | tail -12
for L in 131072 32768; do
  bench_row 1 "$L" "bench-page1-$L-overlap" 100 --page-size 1 --backend hopper
done
(cd "$RESULTS" && tar czf overlap-bench.tgz bench-page1-* && rm -rf bench-page1-*)
