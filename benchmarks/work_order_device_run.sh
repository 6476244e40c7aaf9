#!/usr/bin/env bash
# Device checks and timings of the kept-block work order (csrc/hopper/work_order.hpp, FPV2_HOPPER_WORK_ORDER),
# from the repository root, with a library and test program built on the development machine.
#
#   benchmarks/work_order_device_run.sh checks    fpv2_hopper_prefill_test --mode small with the order forced
#                                                 (one CTA per tile, then persistent CTAs), the grid with the
#                                                 order forced, the binding's GPU tests of it (pytest)
#   benchmarks/work_order_device_run.sh persistent  the grid and --mode small under FPV2_HOPPER_PERSISTENT=1 (the
#                                                 persistent consumers decode each tile from a broadcast index
#                                                 since 2026-12-02), then B=1 timings at 32K and 128K, one CTA
#                                                 per tile vs persistent, at keep 0 and twice at 0.03, and
#                                                 the planted pipeline (fpv2 bench) at 32K and 128K both ways
#   benchmarks/work_order_device_run.sh dynamic   persistent CTAs fed by the tile queue (FPV2_HOPPER_PERSISTENT=dynamic,
#                                                 csrc/hopper/tile_queue.hpp): --mode small, the grid, + work
#                                                 order, its pytest GPU tests; B=1 timings one CTA per tile /
#                                                 dynamic / static snake at keep 0 and twice 0.03; the planted
#                                                 pipeline at 128K and 32K, dynamic vs one CTA per tile
#   benchmarks/work_order_device_run.sh sanitize  memcheck, synccheck and racecheck of --mode small, dynamic tile queue
#                                                 and static snake order; 4 x 128K planted pipeline, dynamic vs
#                                                 one CTA per tile
#   benchmarks/work_order_device_run.sh suites    the grid on the default path, then the kernel package's GPU tests
#                                                 (gpu or hopper marks) on this library; suites-others: the other
#                                                 packages' GPU tests
#   benchmarks/work_order_device_run.sh timings   native timings (median of 10, keep 0.03, page 128) of three
#                                                 uneven batches with the order off / auto (alternating, twice),
#                                                 B=1 at 32K and 128K off / forced, and persistent CTAs with the
#                                                 order off / forced
#
# Prediction (written before the first device run): a 4K chunk after a 124K prefix placed last behind seven
# fresh 4K requests leaves a last partial wave of heavy tiles in the decoded order: dense -2 to -3%, sparse and
# corrected -1 to -3% with the order; the same chunk placed first: unchanged within the order's own cost (two
# small kernels and one dependent load per CTA, ~10 us); fresh requests of mixed lengths <= 2%; B=1 forced: up
# to +3-6% on the random CSR (the order interleaves KV heads, so fewer kept blocks are shared in L2).
#
# Persistent CTAs (prediction, same day): their kept-block loop is back to the one-CTA-per-tile instruction count
# (SASS census: 715 against 712 at d = 128, was 747), so the dense-mode loss (+7.5% at 128K) should mostly go,
# tiles of one kept block keep their -20%, keep 0.03 should move from +5-10% to -3 to -8%, and the planted 128K
# pipeline from 14.8 ms to about 13.1-13.4 (one CTA per tile: 13.5-13.7).
#
# Dynamic tile queue (prediction, 2026-12-02, before its first run): the static snake's 3%-density loss (+4% at
# 32K, +3-7% at 128K against one CTA per tile, same day) is its imbalance (an estimated +-10% spread of the
# CTAs' sums of kept blocks at 32K); claimed dynamically and published a tile ahead, keep 0 keeps the snake's
# -18%, keep 0.03 goes to -3 to -8% at 32K (0.81 -> 0.75-0.79 ms) and -2 to -5% at 128K, dense within +-2% of
# one CTA per tile, the planted 128K pipeline 13.8 -> 13.3-13.6 ms.
#
# Environment: WO_BIN folder with libfpv2_kernel.so and fpv2_hopper_prefill_test [build/kernel]; FPV2_COMMIT
# (recorded by fpv2 bench: the device copy has no git); OUT; logs go to a temporary folder packed into
# $OUT/work-order-<part>.tgz (the device returns few files), summaries to stdout.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start work-order "${1:-checks}" "${WO_BIN:-build/kernel}"
TEST="$BIN/fpv2_hopper_prefill_test"

# B=1 native timings at 32K and 128K (median of 10): time_b1 KEEP PERSISTENT LOG
time_b1() {
  FPV2_HOPPER_PERSISTENT=$2 timeout 100 "$TEST" --mode timing --lengths 32768,131072 --repeats 10 --keep "$1" \
    > "$3" 2>&1
  echo "B=1, keep $1, persistent $2: rc=$?"
  summary "$3"
}

# The planted pipeline through fpv2 bench (alpha 0.1, page 128): bench_pipeline B L PERSISTENT NAME LIMIT
bench_pipeline() {
  FPV2_HOPPER_PERSISTENT=$3 with_packages timeout "$5" python3 -m fpv2.serving bench -B "$1" -L "$2" \
    --page-size 128 --alpha 0.1 --no-progress --out "$LOGS/$4" > "$LOGS/$4.log" 2>&1
  echo "bench B=$1 L=$2 persistent $3: rc=$?"
  grep -E "fpv2-(sparse|dense)" "$LOGS/$4.log" | cut -c1-160
}

if [ "$PART" = checks ]; then
  FPV2_HOPPER_WORK_ORDER=1 timeout 60 "$TEST" --mode small > "$LOGS/small-order.log" 2>&1
  echo "small, order forced: rc=$?"
  FPV2_HOPPER_WORK_ORDER=1 FPV2_HOPPER_PERSISTENT=1 timeout 60 "$TEST" --mode small > "$LOGS/small-order-persistent.log" 2>&1
  echo "small, order forced, persistent: rc=$? pass=$(grep -c '^\[PASS' "$LOGS/small-order-persistent.log")"
  FPV2_HOPPER_WORK_ORDER=1 timeout 240 "$TEST" --mode correctness > "$LOGS/grid-order.log" 2>&1
  echo "grid, order forced: rc=$? pass $(grep -c '^\[PASS' "$LOGS/grid-order.log") fail $(grep -c '^\[FAIL' "$LOGS/grid-order.log")"
  with_packages timeout 200 python3 -m pytest -p no:cacheprovider -q packages/fpv2-kernel/tests/test_hopper_kernel.py \
    -k "work_order or split_kv or forced_splits" > "$LOGS/pytest-order.log" 2>&1
  echo "pytest: rc=$?"
  tail -2 "$LOGS/pytest-order.log"
elif [ "$PART" = persistent ]; then
  timeout 60 "$TEST" --mode small > "$LOGS/small-default.log" 2>&1
  echo "small, default (one CTA per tile, tile_at moved out of the kernel): rc=$? pass=$(grep -c '^\[PASS' "$LOGS/small-default.log")"
  FPV2_HOPPER_PERSISTENT=1 timeout 60 "$TEST" --mode small > "$LOGS/small-persistent.log" 2>&1
  echo "small, persistent: rc=$? pass=$(grep -c '^\[PASS' "$LOGS/small-persistent.log")"
  FPV2_HOPPER_PERSISTENT=1 timeout 240 "$TEST" --mode correctness > "$LOGS/grid-persistent.log" 2>&1
  echo "grid, persistent: rc=$? pass $(grep -c '^\[PASS' "$LOGS/grid-persistent.log") fail $(grep -c '^\[FAIL' "$LOGS/grid-persistent.log") (the FP8 pooled variant is refused there: SKIP)"
  n=0
  for keep in 0.0 0.03 0.03; do
    for persistent in 0 1; do
      n=$((n + 1))
      time_b1 "$keep" "$persistent" "$LOGS/timing-persistent$persistent-keep$keep-$n.log"
    done
  done
  for L in 131072 32768; do
    for persistent in 1 0; do
      bench_pipeline 1 "$L" "$persistent" "bench-$L-persistent$persistent" 90
    done
  done
elif [ "$PART" = timings ]; then
  declare -A MIXES=(
    [heavy-last]="4096@0,4096@0,4096@0,4096@0,4096@0,4096@0,4096@0,4096@126976"
    [heavy-first]="4096@126976,4096@0,4096@0,4096@0,4096@0,4096@0,4096@0,4096@0"
    [fresh-mix]="2048@0,32768@0,1024@0,8192@0,512@0,16384@0,4096@0,24576@0"
  )
  n=0
  for mix in heavy-last heavy-first fresh-mix; do
    for setting in 0 auto 0 auto; do
      n=$((n + 1))
      log="$LOGS/timing-$mix-order-$setting-$n.log"
      FPV2_HOPPER_WORK_ORDER=$setting timeout 100 "$TEST" --mode timing --requests "${MIXES[$mix]}" --repeats 10 \
        --keep 0.03 > "$log" 2>&1
      echo "$mix, order $setting: rc=$?"
      summary "$log"
    done
  done
  for persistent in 0 1; do
    for setting in 0 1; do
      n=$((n + 1))
      log="$LOGS/timing-B1-persistent$persistent-order-$setting-$n.log"
      FPV2_HOPPER_PERSISTENT=$persistent FPV2_HOPPER_WORK_ORDER=$setting timeout 100 "$TEST" --mode timing \
        --lengths 32768,131072 --repeats 10 --keep 0.03 > "$log" 2>&1
      echo "B=1, persistent $persistent, order $setting: rc=$?"
      summary "$log"
    done
  done
elif [ "$PART" = dynamic ]; then
  FPV2_HOPPER_PERSISTENT=dynamic timeout 60 "$TEST" --mode small > "$LOGS/small-dynamic.log" 2>&1
  echo "small, dynamic tile queue: rc=$? pass=$(grep -c '^\[PASS' "$LOGS/small-dynamic.log")"
  FPV2_HOPPER_PERSISTENT=dynamic timeout 200 "$TEST" --mode correctness > "$LOGS/grid-dynamic.log" 2>&1
  echo "grid, dynamic: rc=$? pass $(grep -c '^\[PASS' "$LOGS/grid-dynamic.log") fail $(grep -c '^\[FAIL' "$LOGS/grid-dynamic.log")"
  FPV2_HOPPER_PERSISTENT=dynamic FPV2_HOPPER_WORK_ORDER=1 timeout 60 "$TEST" --mode small > "$LOGS/small-dynamic-order.log" 2>&1
  echo "small, dynamic + work order: rc=$? pass=$(grep -c '^\[PASS' "$LOGS/small-dynamic-order.log")"
  with_packages timeout 150 python3 -m pytest -p no:cacheprovider -q packages/fpv2-kernel/tests/test_hopper_kernel.py \
    -k "dynamic_tile_queue" > "$LOGS/pytest-dynamic.log" 2>&1
  echo "pytest dynamic: rc=$?"
  tail -2 "$LOGS/pytest-dynamic.log"
  n=0
  for keep in 0.0 0.03 0.03; do
    for persistent in 0 dynamic 1; do
      n=$((n + 1))
      time_b1 "$keep" "$persistent" "$LOGS/timing-persistent-$persistent-keep$keep-$n.log"
    done
  done
  for L in 131072 32768; do
    for persistent in dynamic 0; do
      bench_pipeline 1 "$L" "$persistent" "bench-$L-persistent-$persistent" 90
    done
  done
elif [ "$PART" = sanitize ]; then
  # The tile queue's barriers and slots under compute-sanitizer (the static snake order beside it: racecheck's
  # known ValueTailGuard::clear / cp.async class shows in both), then 4 x 128K through the planted pipeline.
  SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  for persistent in dynamic 1; do
    FPV2_HOPPER_PERSISTENT=$persistent timeout 120 "$SAN" --tool memcheck --error-exitcode 3 "$TEST" --mode small \
      > "$LOGS/memcheck-$persistent.log" 2>&1
    echo "memcheck persistent $persistent: rc=$? $(tail -1 "$LOGS/memcheck-$persistent.log")"
    FPV2_HOPPER_PERSISTENT=$persistent timeout 120 "$SAN" --tool synccheck --error-exitcode 3 "$TEST" --mode small \
      > "$LOGS/synccheck-$persistent.log" 2>&1
    echo "synccheck persistent $persistent: rc=$? $(tail -1 "$LOGS/synccheck-$persistent.log")"
    FPV2_HOPPER_PERSISTENT=$persistent timeout 150 "$SAN" --tool racecheck --racecheck-report all "$TEST" --mode small \
      > "$LOGS/racecheck-$persistent.log" 2>&1
    echo "racecheck persistent $persistent: rc=$? $(grep -E 'RACECHECK SUMMARY' "$LOGS/racecheck-$persistent.log" | tail -1)"
  done
  for persistent in dynamic 0; do
    bench_pipeline 4 131072 "$persistent" "bench-4x131072-persistent-$persistent" 150
  done
elif [ "$PART" = suites ] || [ "$PART" = suites-others ]; then
  # suites: the default path (one CTA per tile) over the whole grid, then the kernel package's GPU tests;
  # suites-others: the other packages' GPU tests (150 s did not finish the kernel's ~280 or serving's soak tests).
  if [ "$PART" = suites ]; then
    timeout 150 "$TEST" --mode correctness > "$LOGS/grid-default.log" 2>&1
    echo "grid, default: rc=$? pass $(grep -c '^\[PASS' "$LOGS/grid-default.log") fail $(grep -c '^\[FAIL' "$LOGS/grid-default.log")"
    packages="kernel"
    limit=420
  else
    packages="index correction serving"
    limit=240
  fi
  for package in $packages; do
    with_packages timeout "$limit" python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" "packages/fpv2-$package/tests" \
      > "$LOGS/pytest-gpu-$package.log" 2>&1
    echo "pytest gpu $package: rc=$? $(tail -1 "$LOGS/pytest-gpu-$package.log")"
    tar czf "$OUT/work-order-$PART.tgz" -C "$LOGS" .  # what ran so far, should the call's limit stop it
  done
else
  echo "usage: $0 checks|persistent|timings|dynamic|sanitize|suites|suites-others" >&2
  exit 2
fi
