#!/usr/bin/env bash
# Device run: the second-order mass shift in the Hopper kernel (fpv2.h ABI 1.5, the plan's key spread), on the
# H200, from the repository root, with the library built on the development machine.
#
#   benchmarks/hopper_second_order_device_run.sh tests   the Hopper shift's GPU tests (against the fp64 reference:
#                                                        d 64/128/256, GQA 1/4/8, pages 1/16/128, the FP8 pooled
#                                                        products, split-KV, the refusals), the Hopper kernel's
#                                                        existing GPU tests (the mean path after the new template
#                                                        parameter) and the serving pipeline's GPU tests
#   benchmarks/hopper_second_order_device_run.sh bench   fpv2 bench on the drifting background (--drift-tokens 256),
#                                                        page 1, alpha 0.1 / 0.2 / 0.4, the correction off, mean and
#                                                        second order, on the Hopper backend: 1 x 128K and 1 x 32K;
#                                                        the planted 1 x 128K and 4 x 128K rows (alpha 0.1), the
#                                                        Hopper backend named: a missing library fails the row
#   benchmarks/hopper_second_order_device_run.sh check   the FP8 pooled and split-KV shift tests again (their errors
#                                                        printed), then compute-sanitizer memcheck on four shift
#                                                        cases (gather, TMA, FP8 pooled, split-KV; the fpv2 kernels
#                                                        only) and racecheck on two
#   benchmarks/hopper_second_order_device_run.sh ab      the GPU tests on the library in SCORE_BIN, then whole calls
#                                                        timed per mode (shift_cost_probe.py --repeats 20: off,
#                                                        mean, second order) at 128K / 32K drifting and 128K
#                                                        planted, page 1, two rounds of BASE_BIN then SCORE_BIN;
#                                                        racecheck of two shift cases, reports counted by kernel
#                                                        and site
#   benchmarks/hopper_second_order_device_run.sh ncu     Nsight Compute on the three attention kernels of one 32K
#                                                        drifting call (correction off, mean, second order; same
#                                                        index): instructions per pipe, issue slots, local memory
#
# Predictions (written before the run):
# - tests pass.
# - ptxas (development machine): the mean-correction kernels keep their spills exactly (28 / 36 bytes at d 128);
#   the second-order variant of the default kernel spills 60 / 68 bytes at d 128 and 644 / 652 at d 256.
# - The shift adds an 8-byte shared load per column pair and two FMAs and a min per pooled score, and |q|^2 once
#   per tile. The pooled tiles are about a fifth of the attention time at 128K drifting (the correction's +25%),
#   so the second-order rows' attention time is 3-6% above the mean rows' at the same alpha on Hopper (Triton:
#   +17%).
# - Errors match the Triton kernel's second-order rows of 2026-12-05 within 0.01 (128K drifting 0.092 / 0.128 /
#   0.167 at alpha 0.1 / 0.2 / 0.4; planted 128K 0.010).
# - So at 128K drifting, second order at alpha 0.4 (density 1.8%) runs about 8.2-8.5 ms attention against the
#   mean's 8.66 at alpha 0.1, with error 0.167 against 0.198: faster and more accurate.
#
# Environment: SCORE_BIN folder with libfpv2_kernel.so [.carry/head]; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start hopper-second-order "${1:-bench}" "${SCORE_BIN:-.carry/head}"
RESULTS="$LOGS/results"  # inside the part's archive: the device returns a few files a call
mkdir -p "$RESULTS"

SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
SO=packages/fpv2-kernel/tests/test_second_order_shift.py

# racecheck of the given pytest node ids on the library in $BIN, every report counted by kernel and the two
# sites into $LOGS/racecheck-NAME.txt (the full log is too large to keep): racecheck_classes NAME LIMIT NODE...
racecheck_classes() {
  local name="$1" limit="$2" full
  shift 2
  full="$(mktemp)"
  with_packages timeout "$limit" "$SAN" --tool racecheck --racecheck-report all --print-limit 10000000 \
    --kernel-name kns=prefill_kernel python3 -m pytest -p no:cacheprovider -q "$@" > "$full" 2>&1
  echo "racecheck ($name): rc=$? $(grep -E "RACECHECK SUMMARY|passed|failed" "$full" | tr '\n' ' ' | cut -c1-200)"
  python3 - "$full" > "$LOGS/racecheck-$name.txt" <<'PY'
import collections, re, sys
counts, sites, kernel = collections.Counter(), [], None
def flush():
    if sites:
        counts[(kernel or "?", " / ".join(sites))] += 1
for line in open(sys.argv[1], errors="replace"):
    if "Error: Potential" in line:
        flush(); sites, kernel = [], None
    elif re.match(r"=========\s+(Write|Read) Thread", line):
        site = re.sub(r"Thread \([0-9,]+\)|\+0x[0-9a-f]+|<.*>(?=\()", "", line.strip("= \n"))
        sites.append(re.sub(r"\s+", " ", site))
    elif "Host Frame: void fpv2::hopper::prefill_kernel<" in line:
        kernel = line.split("prefill_kernel<", 1)[1].split(">(", 1)[0]
flush()
for (kernel, site), n in counts.most_common():
    print(f"{n:8d}  {kernel}  |  {site}")
PY
  rm -f "$full"
  head -8 "$LOGS/racecheck-$name.txt" | cut -c1-260
}

SHIFTS=(--ablation --mass-shift mean --mass-shift second_order)
ALPHAS=(--alpha 0.1 --alpha 0.2 --alpha 0.4)

if [ "$PART" = tests ]; then
  gpu_tests hopper-second-order 300 packages/fpv2-kernel/tests/test_second_order_shift.py -m "hopper or gpu"
  gpu_tests hopper-kernel 300 packages/fpv2-kernel/tests/test_hopper_kernel.py -m hopper
  gpu_tests serving-pipeline 240 packages/fpv2-serving/tests/test_serving_pipeline.py \
    packages/fpv2-serving/tests/test_fallback_backend.py
fi

if [ "$PART" = bench ]; then
  bench_row 1 131072 bench-128k-drifting-hopper 240 --page-size 1 --drift-tokens 256 --backend hopper \
    "${SHIFTS[@]}" "${ALPHAS[@]}"
  bench_row 1 32768 bench-32k-drifting-hopper 150 --page-size 1 --drift-tokens 256 --backend hopper \
    "${SHIFTS[@]}" "${ALPHAS[@]}"
  bench_row 1 131072 bench-128k-planted-hopper 200 --page-size 1 --backend hopper "${SHIFTS[@]}"
  bench_row 4 131072 bench-4x128k-planted-hopper 330 --page-size 1 --backend hopper --mass-shift mean --mass-shift second_order
fi

if [ "$PART" = check ]; then
  gpu_tests fp8-and-splits 120 "$SO" -s -k test_hopper_shift_with_fp8_pooled_products_and_split_kv
  grep "^hopper shift" "$LOGS/pytest-fp8-and-splits.log" | cut -c1-250
  CASES=("$SO::test_hopper_shift_against_the_reference[128-4-1]" "$SO::test_hopper_shift_against_the_reference[128-4-128]"
    "$SO::test_hopper_shift_with_fp8_pooled_products_and_split_kv[128-pooled-e4m3]"
    "$SO::test_hopper_shift_with_fp8_pooled_products_and_split_kv[128-splits]")
  # Only the project's kernels are instrumented (kns: a substring of the kernel's name).
  with_packages timeout 180 "$SAN" --tool memcheck --error-exitcode 3 --kernel-name kns=fpv2 \
    python3 -m pytest -p no:cacheprovider -q "${CASES[@]}" > "$LOGS/memcheck.log" 2>&1
  echo "memcheck: rc=$? $(grep -E "ERROR SUMMARY|passed|failed" "$LOGS/memcheck.log" | tr '\n' ' ' | cut -c1-200)"
  racecheck_classes check 120 "${CASES[0]}" "${CASES[3]}"
fi

if [ "$PART" = ncu ]; then
  NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
  METRICS=gpu__time_duration.sum,sm__inst_executed.sum,sm__instruction_throughput.avg.pct_of_peak_sustained_active
  METRICS+=,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
  METRICS+=,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
  METRICS+=,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
  METRICS+=,smsp__sass_inst_executed_op_local_ld.sum,smsp__sass_inst_executed_op_local_st.sum
  with_packages timeout 150 "$NCU" --clock-control none --profile-from-start off --kernel-name regex:prefill_kernel \
    --csv --metrics "$METRICS" python3 benchmarks/shift_cost_probe.py --seqlen 32768 --drift-tokens 256 \
    > "$RESULTS/ncu-32k-drifting.csv" 2> "$LOGS/ncu.err"
  echo "ncu: rc=$?"
  grep -v "^==" "$RESULTS/ncu-32k-drifting.csv" | grep -v "^profiled" |
    awk -F'","' 'NR>1 {print $1" | "$(NF-2)" | "$(NF-1)" | "$NF}' | sed 's/"//g' | cut -c1-160
  tail -3 "$LOGS/ncu.err"
fi

if [ "$PART" = ab ]; then
  gpu_tests second-order 200 "$SO" -m "hopper or gpu"
  gpu_tests hopper-kernel 200 packages/fpv2-kernel/tests/test_hopper_kernel.py -m hopper
  NEW="$BIN"
  for round in 1 2; do
    for lib in "${BASE_BIN:-.carry/base}" "$NEW"; do
      for shape in "--seqlen 131072 --drift-tokens 256" "--seqlen 32768 --drift-tokens 256" "--seqlen 131072"; do
        # shellcheck disable=SC2086  # the shape is a list of options
        BIN="$lib" with_packages timeout 90 python3 benchmarks/shift_cost_probe.py $shape --page-size 1 --repeats 20 \
          --label "$(basename "$lib")" 2>> "$LOGS/ab.err" | tail -1 | tee -a "$RESULTS/ab-round$round.jsonl"
      done
    done
  done
  racecheck_classes classes 150 "$SO::test_hopper_shift_against_the_reference[128-4-1]" \
    "$SO::test_hopper_shift_against_the_reference[128-4-128]"
fi
