#!/usr/bin/env bash
# Device checks and timings of the cp.async gather's lane layouts (csrc/hopper/kv_gather_producer.hpp: lane
# pairs 2026-12-02, four lanes a row 2026-12-03), from the repository root, with libraries and test programs
# built on the development machine.
#
#   benchmarks/gather_pairs_device_run.sh checks   fpv2_hopper_prefill_test --mode small (plain and under
#                                                  compute-sanitizer memcheck) and the whole correctness grid
#                                                  (page sizes 1/16/24/64/128/256, every built head dim) on the
#                                                  new library, then B=1 native timings (32K and 128K, keep 0.03,
#                                                  dense / sparse / corrected) at page sizes 1 and 16, base
#                                                  library then new
#   benchmarks/gather_pairs_device_run.sh timings  the same timings again in the other order (new, then base; with
#                                                  a base library only), the planted pipeline (fpv2 bench, page
#                                                  size 1) at 32K and 128K on the new library with the Hopper and
#                                                  the Triton backends, and the fallback backend's tests
#   benchmarks/gather_pairs_device_run.sh ab       base / new / new / base native timings of the TMA path (page 128,
#                                                  d=128 and 256, 32K and 128K), the 32K page-1 pipeline rows again,
#                                                  and the page-1 routing curve on the Hopper backend
#   benchmarks/gather_pairs_device_run.sh producer40  base (32 producer registers) / 40 / 40 / base native timings
#                                                  at page 1 and 128, then ncu of the base's page-1 32K dense and
#                                                  corrected launches (scripts/profile_hopper.sh)
#   benchmarks/gather_pairs_device_run.sh producer-fence  checks of the producer-fenced gather, base / new / new / base
#                                                  timings at page 1 and 128 (d=256 page 1 once each), and, if
#                                                  faster, the page-1 pipeline rows and the kernel's GPU tests
#   benchmarks/gather_pairs_device_run.sh quads    four lanes per row against the pairs: grid, base / new page-1 timings
#   benchmarks/gather_pairs_device_run.sh quads-more  new / base page-1 timings, d=256 page 1 both, memcheck, and the
#                                                  page-1 pipeline at 128K on the new library
#
# Prediction (written before the first device run): the row-per-thread gather is L2-bound at page size 1 (ncu,
# 32K dense: L2 95% busy serving two half-used sectors per 32-byte sector). Lane pairs read whole sectors with the
# same number of copy steps per thread, so the L2 traffic halves: dense 32K page 1 25.9 -> 17-20 ms (TMA path at
# page 128: 14.2), dense 128K 633 -> 400-470 ms, sparse 128K 18.5 -> 12-14 ms, corrected 21.2 -> 15-17 ms;
# page 16 about the same as page 1 (the same gather, fewer distinct pages).
#
# Environment: BASE_BIN (optional: without it only the new library is timed) and NEW_BIN folders with
# fpv2_hopper_prefill_test (NEW_BIN also with libfpv2_kernel.so for
# the timings part's pipeline rows) [.carry/base, .carry/pairs]; FPV2_COMMIT (recorded by fpv2 bench: the device
# copy has no git); OUT; logs go to a temporary folder packed into $OUT/gather-pairs-<part>.tgz, summaries to stdout.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start gather-pairs "${1:-checks}" "${NEW_BIN:-.carry/pairs}"
BASE_BIN="${BASE_BIN:-.carry/base}"
RESULTS="$OUT"

# B=1 native timings at 32K and 128K (median of 10, keep 0.03): time_b1 BIN PAGE LOG; a BIN without the test
# program (no base library carried) is skipped
time_b1() {
  [ -x "$1/fpv2_hopper_prefill_test" ] || { echo "$1: no fpv2_hopper_prefill_test, skipped"; return 0; }
  timeout 150 "$1/fpv2_hopper_prefill_test" --mode timing --lengths 32768,131072 --repeats 10 --keep 0.03 \
    --page-size "$2" > "$3" 2>&1
  echo "$1 page $2: rc=$?"
  summary "$3"
}

# Checks of $BIN's test program: memcheck_small (the small cases plain and under compute-sanitizer memcheck),
# grid LIMIT (the whole correctness grid).
memcheck_small() {
  timeout 60 "$BIN/fpv2_hopper_prefill_test" --mode small > "$LOGS/small.log" 2>&1
  echo "small: rc=$? pass=$(grep -c '^\[PASS' "$LOGS/small.log")"
  local san
  san="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
  timeout 120 "$san" --tool memcheck --error-exitcode 3 "$BIN/fpv2_hopper_prefill_test" --mode small \
    > "$LOGS/memcheck.log" 2>&1
  echo "memcheck small: rc=$? $(tail -1 "$LOGS/memcheck.log")"
}
grid() {
  timeout "$1" "$BIN/fpv2_hopper_prefill_test" --mode correctness > "$LOGS/grid.log" 2>&1
  echo "grid: rc=$? pass $(grep -c '^\[PASS' "$LOGS/grid.log") fail $(grep -c '^\[FAIL' "$LOGS/grid.log")"
  grep '^\[FAIL' "$LOGS/grid.log" | head -5
}

# base / new / new / base: alternate NEW_NAME STEP runs STEP NAME BIN ROUND for each, NAME "base" or NEW_NAME.
alternate() {
  local new_name="$1" step="$2" round=0 name bin
  for name in base "$new_name" "$new_name" base; do
    round=$((round + 1))
    bin=$([ "$name" = base ] && echo "$BASE_BIN" || echo "$BIN")
    "$step" "$name" "$bin" "$round"
  done
}
# Steps for alternate: pages 1 and 128 at d=128; the TMA path (page 128) at d=128 and 256.
time_pages_1_128() {
  local page
  for page in 1 128; do
    time_b1 "$2" "$page" "$LOGS/timing-$1-page$page-$3.log"
  done
}
time_tma_128_256() {
  local d
  for d in 128 256; do
    timeout 150 "$2/fpv2_hopper_prefill_test" --mode timing --lengths 32768,131072 --repeats 10 --keep 0.03 \
      --page-size 128 --head-dim "$d" > "$LOGS/timing-$1-d$d-page128-$3.log" 2>&1
    echo "$1 d=$d page 128 (step $3): rc=$?"
    summary "$LOGS/timing-$1-d$d-page128-$3.log"
  done
}
# d=256 at page 1, 32K: time_d256_page1 NAME BIN
time_d256_page1() {
  timeout 100 "$2/fpv2_hopper_prefill_test" --mode timing --lengths 32768 --repeats 10 --keep 0.03 \
    --page-size 1 --head-dim 256 > "$LOGS/timing-$1-d256-page1.log" 2>&1
  echo "$1 d=256 page 1: rc=$?"
  summary "$LOGS/timing-$1-d256-page1.log"
}

if [ "$PART" = checks ]; then
  memcheck_small
  grid 200
  for page in 1 16; do
    time_b1 "$BASE_BIN" "$page" "$LOGS/timing-base-page$page-1.log"
    time_b1 "$BIN" "$page" "$LOGS/timing-pairs-page$page-1.log"
  done
elif [ "$PART" = timings ]; then
  if [ -x "$BASE_BIN/fpv2_hopper_prefill_test" ]; then  # the second order of the A/B
    for page in 1 16; do
      time_b1 "$BIN" "$page" "$LOGS/timing-pairs-page$page-2.log"
      time_b1 "$BASE_BIN" "$page" "$LOGS/timing-base-page$page-2.log"
    done
  fi
  for L in 131072 32768; do
    for backend in hopper triton; do
      bench_row 1 "$L" "bench-page1-$L-$backend" 120 --page-size 1 --backend "$backend"
    done
  done
  # auto on this GPU: the Hopper backend serves small pages now (test_fallback_backend.py, GPU branch).
  with_packages timeout 120 python3 -m pytest -p no:cacheprovider -q packages/fpv2-serving/tests/test_fallback_backend.py \
    > "$LOGS/pytest-fallback.log" 2>&1
  echo "pytest fallback: rc=$? $(tail -1 "$LOGS/pytest-fallback.log")"
elif [ "$PART" = ab ]; then
  # The removal of the other gather layouts changed every instantiation's code: the TMA path at d=128 and d=256
  # (page 128, whose d=256 overlapped consumers went 56 -> 64 B of stack), base / new / new / base.
  alternate new time_tma_128_256
  for backend in hopper triton; do
    bench_row 1 32768 "bench-page1-32768-$backend" 120 --page-size 1 --backend "$backend"
  done
  # The routing curve at page size 1 on the backend auto now runs there.
  with_packages timeout 200 python3 benchmarks/routing_switch_point.py --backend hopper --page-sizes 1 \
    --out "$RESULTS/routing-page1-hopper" > "$LOGS/routing.log" 2>&1
  echo "routing: rc=$?"
  tail -5 "$LOGS/routing.log"
  tar czf "$RESULTS/ab-results.tgz" -C "$RESULTS" bench-page1-32768-hopper bench-page1-32768-triton routing-page1-hopper
elif [ "$PART" = producer40 ]; then
  # The producer warpgroup at 40 registers instead of 32 (d <= 128; 40 + 2 x 232 = 504, the launch allocation):
  # base (BASE_BIN, 32) / 40 (BIN) / 40 / base at page 1 and page 128, then ncu of the base's 32K page-1 dense
  # and corrected launches (scripts/profile_hopper.sh: stall reasons, hottest SASS).
  alternate r40 time_pages_1_128
  OUT="$LOGS/profile" PROFILE_BINARY="$BASE_BIN/fpv2_hopper_prefill_test" PROFILE_PAGE_SIZE=1 \
    PROFILE_LAUNCHES="1 5" timeout 300 bash scripts/profile_hopper.sh > "$LOGS/profile.log" 2>&1
  echo "profile: rc=$?"
  grep -E "^===|L2|Throughput|Stall|stall" "$LOGS/profile.log" | head -30
  for f in "$LOGS"/profile/ncu-*.txt; do
    echo "--- $f"
    grep -E "Duration|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|DRAM Throughput|Compute \(SM\)|Issued Ipc|Warp Cycles Per Issued" "$f" | head -12
  done
elif [ "$PART" = producer-fence ]; then
  # The gather's stages fenced into the async proxy by the producer threads, not the consumers: checks on the
  # new library, base (BASE_BIN) / new / new / base timings at page 1 and 128, d=256 at page 1 once each; if
  # the new page-1 dense time is lower, the page-1 pipeline rows on the new library and the kernel's GPU tests.
  memcheck_small
  grid 200
  alternate new time_pages_1_128
  time_d256_page1 base "$BASE_BIN"
  time_d256_page1 new "$BIN"
  dense_ms() { grep -m1 "fpv2-hopper-dense" "$1" | sed -E 's/.*median ([0-9.]+) ms.*/\1/'; }
  if awk -v n="$(dense_ms "$LOGS/timing-new-page1-2.log")" -v b="$(dense_ms "$LOGS/timing-base-page1-1.log")" \
    'BEGIN { exit !(n < b) }'; then
    for L in 131072 32768; do
      bench_row 1 "$L" "bench-page1-$L-hopper" 120 --page-size 1 --backend hopper
    done
    tar czf "$RESULTS/bench-results.tgz" -C "$RESULTS" bench-page1-131072-hopper bench-page1-32768-hopper
    with_packages timeout 300 python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" packages/fpv2-kernel/tests \
      > "$LOGS/pytest-kernel-gpu.log" 2>&1
    echo "kernel GPU tests: rc=$? $(tail -1 "$LOGS/pytest-kernel-gpu.log")"
  else
    echo "new page-1 dense not faster: no pipeline rows, no GPU tests"
  fi
elif [ "$PART" = quads ]; then
  # Four lanes per token row (two sectors a request) against the lane pairs (BASE_BIN): the correctness grid on
  # the new build, then base / new timings at page 1 (one order only: a short call).
  grid 100
  time_b1 "$BASE_BIN" 1 "$LOGS/timing-base-page1.log"
  time_b1 "$BIN" 1 "$LOGS/timing-quads-page1.log"
elif [ "$PART" = quads-more ]; then
  # The second order (quads, then pairs), d=256 at page 1 both ways, memcheck of the small cases, and the
  # page-1 pipeline at 128K on the quads library.
  time_b1 "$BIN" 1 "$LOGS/timing-quads-page1-2.log"
  time_b1 "$BASE_BIN" 1 "$LOGS/timing-base-page1-2.log"
  time_d256_page1 quads "$BIN"
  time_d256_page1 base "$BASE_BIN"
  memcheck_small
  bench_row 1 131072 bench-page1-131072-hopper 60 --page-size 1 --backend hopper
else
  echo "usage: $0 checks|timings|ab|producer40|producer-fence|quads|quads-more" >&2
  exit 2
fi
