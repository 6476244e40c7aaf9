#!/usr/bin/env bash
# Device run of the tile repack at page size 1 (fpv2.kernel.triton.tile_repack, chosen by
# fpv2.serving.tile_repack_policy), from the repository root, with the library built on the development machine.
#
#   benchmarks/tile_repack_device_run.sh [all]  the repack's own GPU time (32K, 128K, 4 x 128K), the planted pipeline
#                                          at page 1 with FPV2_HOPPER_REPACK=auto / 0 / auto at 128K and 32K, 4 x 128K
#                                          with auto, then the GPU tests of the repack and its policy
#   benchmarks/tile_repack_device_run.sh sweep  the repack's (tokens, warps) sweep at 32K and 128K, the 128K pipeline
#                                          auto / 0 / auto and 32K auto / 0, then the GPU tests
#   benchmarks/tile_repack_device_run.sh prefix  chunks of 4K-64K queries after a 128K KV, copy forced on and off
#                                          (benchmarks/tile_repack_prefix.py): where the policy's threshold should be.
#                                          Prediction: the copy (0.34 ms) pays from a quarter to a half of the keys
#
# Prediction (written before the run): the repack moves 2 x 0.54 GB at 128K (K and V read once and written once),
# 0.3-0.4 ms at 3-3.5 TB/s; the kernel then runs the TMA path (corrected 128K at page 128: 11.2-11.5 ms eager
# attention against 14.2-14.8 at page 1): the page-1 pipeline at 128K 16.5-17.0 -> 13.5-14.3 ms eager, 32K
# 3.2-3.4 -> 2.3-2.6 ms, the dense row 270-277 -> 205-215 ms at 128K.
#
# Environment: REPACK_BIN folder with libfpv2_kernel.so [.carry/head]; FPV2_COMMIT (recorded by fpv2 bench); OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start tile-repack "${1:-all}" "${REPACK_BIN:-.carry/head}"
RESULTS="$OUT"

if [ "$PART" = prefix ]; then
  with_packages timeout 200 python3 benchmarks/tile_repack_prefix.py --seqlen 131072 --chunks 4096 16384 32768 65536 \
    --repeats 8 --out "$RESULTS/repack-prefix.json" > "$LOGS/repack-prefix.log" 2>&1
  echo "repack prefix: rc=$?"
  cut -c1-220 "$LOGS/repack-prefix.log"
  exit 0
fi
if [ "$PART" = sweep ]; then
  with_packages timeout 150 python3 benchmarks/tile_repack_speed.py --lengths 32768 131072 --batch 1 --sweep \
    --out "$RESULTS/repack-sweep.json" > "$LOGS/repack-sweep.log" 2>&1
  echo "repack sweep: rc=$?"
  cut -c1-200 "$LOGS/repack-sweep.log"
else
  with_packages timeout 120 python3 benchmarks/tile_repack_speed.py --lengths 32768 131072 --batch 1 4 \
    --out "$RESULTS/repack-speed.json" > "$LOGS/repack-speed.log" 2>&1
  echo "repack speed: rc=$?"
  cut -c1-160 "$LOGS/repack-speed.log"
fi
for L in 131072 32768; do
  round=0
  modes="auto 0 auto"
  [ "$PART" = sweep ] && [ "$L" = 32768 ] && modes="auto 0"
  for mode in $modes; do
    round=$((round + 1))
    export FPV2_HOPPER_REPACK="$mode"
    bench_row 1 "$L" "bench-page1-$L-repack-$mode-$round" 90 --page-size 1 --backend hopper
  done
done
if [ "$PART" != sweep ]; then
  export FPV2_HOPPER_REPACK=auto
  bench_row 4 131072 bench-page1-4x131072-repack-auto 200 --page-size 1 --backend hopper
fi
with_packages timeout 150 python3 -m pytest -p no:cacheprovider -q packages/fpv2-kernel/tests/test_tile_repack.py \
  packages/fpv2-serving/tests/test_tile_repack_policy.py > "$LOGS/pytest-repack.log" 2>&1
echo "repack GPU tests: rc=$? $(tail -1 "$LOGS/pytest-repack.log")"
# Only a few files come back from the device: the bench folders travel as one archive.
(cd "$RESULTS" && tar czf repack-bench.tgz bench-page1-* && rm -rf bench-page1-*)
