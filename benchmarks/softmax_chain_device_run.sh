#!/usr/bin/env bash
# Device run: the A/B of candidate builds of the Hopper attention kernel and the landing checks on a winner, from
# the repository root, with the libraries built on the development machine (benchmarks/experiments/). Written for
# the 28th session's softmax changes (rejected: results/2026-12-06-h100-softmax-ab/).
#
#   benchmarks/softmax_chain_device_run.sh land  the Hopper kernel's GPU suite, the second-order shift's GPU tests
#                                                and the native ABI tests; compute-sanitizer memcheck and racecheck
#                                                of two kernel cases (TMA and page-1 gather, corrected); then fpv2
#                                                bench of the planted pipeline at page 1 (Hopper backend, mean
#                                                correction): 1 x 128K and 4 x 128K, the rows of issue #5
#   benchmarks/softmax_chain_device_run.sh ab-land  the A/B of the libraries CANDIDATES="LABEL=FOLDER ..." against
#                                                BIN (attention kernel alone, 128K and 32K, ROUNDS rounds [2]),
#                                                then part land's checks on the winner (pick_library.py), if any
#
# Prediction: the A/B of the speed part (library_ab_device_run.sh) carries over to the pipeline's attention
# stage; the tests pass (the lse moves only by the bf16 rounding of P in the sums). The bench rows sample the SM
# clock (with_clocks): the 4 x 128K row's attention is ~3% more than four 128K rows' (26th session: 46.92 against
# 4 x 11.39 ms); if its median clock is >= 3% below the 128K row's, that excess is the power state, not the kernel.
#
# Environment: BIN folder with libfpv2_kernel.so [.carry/head]; CANDIDATES and ROUNDS (part ab-land); OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start softmax-chain "${1:-land}" "${BIN:-.carry/head}"
RESULTS="$OUT"
SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
KT=packages/fpv2-kernel/tests/test_hopper_kernel.py

# The landing checks of the library in $BIN, most needed first: the Hopper kernel's GPU suite, memcheck of two
# corrected kernel cases (page-1 gather and TMA), fpv2 bench of the planted 1 x 128K row (page 1, Hopper backend,
# mean correction), then the second-order shift's and the native ABI's GPU tests, racecheck, and the 4 x 128K row.
# The bench rows run under with_clocks.
land_checks() {
  gpu_tests hopper-kernel 200 "$KT" -m hopper
  local cases=("$KT::test_sparse_with_and_without_correction[128-4-1-True]"
    "$KT::test_sparse_with_and_without_correction[128-4-128-True]")
  sanitize() {
    with_packages timeout 90 "$SAN" --tool "$1" --kernel-name kns=prefill_kernel \
      python3 -m pytest -p no:cacheprovider -q "${cases[@]}" > "$LOGS/$1.log" 2>&1
    echo "$1: rc=$? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$LOGS/$1.log" | tr '\n' ' ' | cut -c1-200)"
  }
  sanitize memcheck
  with_clocks 128k bench_row 1 131072 bench-128k-planted-page1 120 --page-size 1 --backend hopper
  gpu_tests second-order 90 packages/fpv2-kernel/tests/test_second_order_shift.py -m "hopper or gpu"
  gpu_tests native 60 packages/fpv2-kernel/tests/test_native_abi.py
  sanitize racecheck
  with_clocks 4x128k bench_row 4 131072 bench-4x128k-planted-page1 150 --page-size 1 --backend hopper
}

if [ "$PART" = land ]; then
  land_checks
fi

if [ "$PART" = ab-land ]; then
  # The candidates' attention A/B (attention_rounds: 128K and 32K, correction off and mean, ROUNDS rounds), then
  # the landing checks on the winner that pick_library.py names (>= 1.5% faster at 128K mean, no row > 1% slower).
  read_candidates "${CANDIDATES:?CANDIDATES=\"LABEL=FOLDER ...\" names the candidate libraries}"
  attention_rounds "${ROUNDS:-2}" off,mean attention-ab.jsonl "shipped=$BIN" "${CANDIDATE_LIST[@]}"
  attention_table attention-ab.jsonl
  WINNER="$(python3 benchmarks/pick_library.py "$RESULTS/attention-ab.jsonl" "${CANDIDATE_LIST[@]}" 2> "$RESULTS/pick.txt")"
  cat "$RESULTS/pick.txt"
  if [ -n "$WINNER" ]; then
    BIN="${WINNER#*=}"
    echo "landing checks on $WINNER"
    land_checks
  fi
fi
