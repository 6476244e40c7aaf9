#!/usr/bin/env bash
# Device run: landing a change to the Hopper attention kernel's softmax (the 28th session's row sums on the tensor
# cores and the tree row maximum, benchmarks/experiments/), from the repository root, with the library built on
# the development machine into BIN.
#
#   benchmarks/softmax_chain_device_run.sh land  the Hopper kernel's GPU suite, the second-order shift's GPU tests
#                                                and the native ABI tests; compute-sanitizer memcheck and racecheck
#                                                of two kernel cases (TMA and page-1 gather, corrected); then fpv2
#                                                bench of the planted pipeline at page 1 (Hopper backend, mean
#                                                correction): 1 x 128K and 4 x 128K, the rows of issue #5
#
# Prediction: the A/B of the speed part (library_ab_device_run.sh) carries over to the pipeline's attention
# stage; the tests pass (the lse moves only by the bf16 rounding of P in the sums).
#
# Environment: BIN folder with libfpv2_kernel.so [.carry/head]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start softmax-chain "${1:-land}" "${BIN:-.carry/head}"
RESULTS="$OUT"
SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
KT=packages/fpv2-kernel/tests/test_hopper_kernel.py

if [ "$PART" = land ]; then
  gpu_tests hopper-kernel 200 "$KT" -m hopper
  gpu_tests second-order 90 packages/fpv2-kernel/tests/test_second_order_shift.py -m "hopper or gpu"
  gpu_tests native 60 packages/fpv2-kernel/tests/test_native_abi.py
  CASES=("$KT::test_sparse_with_and_without_correction[128-4-1-True]"
    "$KT::test_sparse_with_and_without_correction[128-4-128-True]")
  for tool in memcheck racecheck; do
    with_packages timeout 90 "$SAN" --tool "$tool" --kernel-name kns=prefill_kernel \
      python3 -m pytest -p no:cacheprovider -q "${CASES[@]}" > "$LOGS/$tool.log" 2>&1
    echo "$tool: rc=$? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$LOGS/$tool.log" | tr '\n' ' ' |
      cut -c1-200)"
  done
  bench_row 1 131072 bench-128k-planted-page1 120 --page-size 1 --backend hopper
  bench_row 4 131072 bench-4x128k-planted-page1 150 --page-size 1 --backend hopper
fi
