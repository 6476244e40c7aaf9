#!/usr/bin/env bash
# Device run: issue 5's record rows (full or sparse-only, one process a row), the pipeline's kernel split and
# library A/Bs of the index's scoring kernel, from the repository root, with libraries built on the development
# machine. Written in the 31st session; its runs (parts series, protocol, kernels, index, and the since-removed
# parts zero-all, scoring-ab and keys-tma at commits dcf2888..942a90e, whose experiments landed) and their
# predictions are in benchmarks/results/2026-12-06-h100-record-series/.
#
#   benchmarks/record_series_device_run.sh series    RUNS [3] fpv2 bench rows each of 128K and 4 x 128K (page 1,
#                                                    the Hopper backend, mean correction, --sparse-only), one
#                                                    process a row, the two lengths alternating
#   benchmarks/record_series_device_run.sh record    RUNS [3] full fpv2 bench rows each of 128K and 4 x 128K (own
#                                                    dense mode and SDPA too: issue 5's record protocol), page 1,
#                                                    Hopper backend, mean correction, one process a row
#   benchmarks/record_series_device_run.sh protocol  RUNS [2] pairs of 128K rows as above, the full bench (own dense
#                                                    mode and SDPA first) then --sparse-only
#   benchmarks/record_series_device_run.sh index     the index package's GPU suite (with the Hopper scoring, the
#                                                    default on sm_90)
#   benchmarks/record_series_device_run.sh kernels   pipeline_profile.py at 128K, B = 1 and B = 4 (page 1, Hopper
#                                                    backend): each kernel's GPU time
#   benchmarks/record_series_device_run.sh gap       host_ahead_gap_probe.py at 128K (page 1, Hopper backend, mean
#                                                    correction): the bench's host-ahead time against the same
#                                                    calls' kernels under torch.profiler (sum, gaps, span)
#   benchmarks/record_series_device_run.sh scoring-candidate  a scoring-kernel candidate in CAND_BIN: a smoke call
#                                                    (a wrong barrier phase would hang every later call), the
#                                                    scoring GPU tests, the kernel's time at 128K (bf16 / fp16,
#                                                    d = 128 / 64) against BIN, one process a library, A B B A,
#                                                    memcheck and racecheck, the index package's GPU suite
#
# Predictions (written before the runs):
# - record (on an H200, with the scoring kernel of 942a90e): 128K host-ahead 12.95-13.15 ms (the 26th session's
#   13.248 less the scoring kernel's ~0.16 ms, within the spread between processes), 4 x 128K 54.0-54.4 (54.875
#   less ~0.6). 4 x 128K stays above 50.
# - record (35th session, on an H200, with the library of 79a5df6: the 33rd session's default tile schedule,
#   -5.5 to -6.0% of the attention at 128K and -1.6% at 4 x 128K on H100 rows): 128K host-ahead 12.6-12.8 ms (the
#   32nd session's H200 13.27-13.30 less ~0.65), 4 x 128K 53.0-54.3 (53.9-55.1 less ~0.8). 128K meets 13;
#   4 x 128K stays above 50.
#   Measured (38th session, an H200, RUNS=1 twice; results/2026-12-06-h200-record-rows-default-schedule/): 128K
#   12.875 / 12.797 ms host-ahead (attention 11.109 / 11.053 against 11.54-11.56 before, -3.9%), 4 x 128K 54.186 /
#   54.635 (unchanged). 128K meets 13 on the host-ahead time (eager 13.52-13.57); 4 x 128K stays above 50.
# - scoring-candidate with score-empty-barriers.patch: the step's __syncthreads held 10.2% of the
#   scoring kernel's stall samples (lines profile, before the keys by TMA). Without it a warp waits only for its
#   keys (full barrier), and thread 0 before a refill only for every warp's previous product, not its reduction;
#   the wgmma stays a warpgroup collective, so the warps still meet once a product. Expected: 2-5% off the kernel
#   at 128K, same kept pairs, tests and sanitizers clean (racecheck matters here: the buffers are now released by
#   mbarrier arrivals only). Below 1%: rejected.
#   Measured (32nd session, H100): 0.0 to +0.8% slower, clean; rejected
#   (benchmarks/results/2026-12-06-h100-scoring-empty-barriers/).
# - gap (32nd session, after H200 rows of 13.23-13.30 ms host-ahead against a kernel sum of 12.94 in
#   pipeline_profile's eager calls): the profiled host-ahead calls' gaps total <= 0.05 ms and their kernels sum to
#   within 0.05 ms of the events, so the 0.3 ms is the kernels running slower in host-ahead calls (after the spin)
#   than back to back, not idle time. A gap >= 0.2 ms at one kernel boundary would say the opposite.
#
# Environment: BIN folder with the shipped libfpv2_kernel.so [.carry/head]; CAND_BIN [.carry/candidate]; RUNS; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start record-series "${1:-series}" "${BIN:-.carry/head}"
RESULTS="$LOGS/results"  # inside the part's archive: the device returns files at most two folders down
mkdir -p "$RESULTS"

if [ "$PART" = series ]; then
  for run in $(seq 1 "${RUNS:-3}"); do
    bench_row 1 131072 "bench-128k-$run" 120 --page-size 1 --backend hopper --sparse-only
    bench_row 4 131072 "bench-4x128k-$run" 200 --page-size 1 --backend hopper --sparse-only
  done
fi

if [ "$PART" = record ]; then
  for run in $(seq 1 "${RUNS:-3}"); do
    bench_row 1 131072 "bench-128k-$run" 150 --page-size 1 --backend hopper
    bench_row 4 131072 "bench-4x128k-$run" 280 --page-size 1 --backend hopper
  done
fi

if [ "$PART" = protocol ]; then
  for run in $(seq 1 "${RUNS:-2}"); do
    bench_row 1 131072 "bench-128k-full-$run" 150 --page-size 1 --backend hopper
    bench_row 1 131072 "bench-128k-sparse-only-$run" 120 --page-size 1 --backend hopper --sparse-only
  done
fi

if [ "$PART" = series ] || [ "$PART" = record ] || [ "$PART" = protocol ]; then
  sparse_rows_table
fi

if [ "$PART" = kernels ]; then
  for batch in 1 4; do
    with_packages timeout 200 python3 benchmarks/pipeline_profile.py --seqlen 131072 --batch "$batch" --page-size 1 \
      --backend hopper --repeats 5 --out "$RESULTS/kernels-b$batch" > "$RESULTS/kernels-b$batch.txt" 2>&1
    echo "pipeline_profile B=$batch: rc=$?"
    grep -E "^==.*wall|^ +[0-9]+\.[0-9]{3}  " "$RESULTS/kernels-b$batch.txt" | cut -c1-150
  done
fi

if [ "$PART" = scoring-candidate ]; then
  CAND="${CAND_BIN:-.carry/candidate}"
  BIN="$CAND" with_packages timeout 60 python3 benchmarks/hopper_scoring_sanitize.py > "$LOGS/smoke.log" 2>&1
  smoke=$?
  echo "smoke: rc=$smoke $(tail -1 "$LOGS/smoke.log")"
  if [ "$smoke" -eq 0 ]; then
    BIN="$CAND" gpu_tests scoring-candidate 150 packages/fpv2-index/tests/test_hopper_scoring.py -m gpu
    for lib in "$BIN" "$CAND" "$CAND" "$BIN"; do
      BIN="$lib" with_packages timeout 150 python3 benchmarks/scoring_switch_probe.py --shapes 1x131072 \
        --dtypes bf16 fp16 --head-dims 128 64 --rounds 3 --label "$lib" --out "$RESULTS/scoring-ab.jsonl" \
        >> "$LOGS/scoring-ab.log" 2>&1
      echo "probe $lib: rc=$?"
    done
    python3 -c 'import json,sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["label"], r["dtype"], "d", r["d"], "kernel us", r["scoring_kernel_us"]["built"], "kept", r["kept_pairs"])' \
      "$RESULTS/scoring-ab.jsonl"
    for tool in memcheck racecheck; do
      BIN="$CAND" with_packages timeout 100 compute-sanitizer --tool "$tool" --kernel-name kns=score \
        python3 benchmarks/hopper_scoring_sanitize.py > "$RESULTS/sanitizer-$tool.txt" 2>&1
      echo "compute-sanitizer $tool: rc=$? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$RESULTS/sanitizer-$tool.txt")"
    done
    BIN="$CAND" gpu_tests index-candidate 150 packages/fpv2-index/tests -m gpu
  fi
fi

if [ "$PART" = gap ]; then
  with_packages timeout 240 python3 benchmarks/host_ahead_gap_probe.py --seqlen 131072 --rounds 8 \
    --out "$RESULTS/host-ahead-gap-128k.json" > "$RESULTS/host-ahead-gap-128k.txt" 2>&1
  echo "gap probe: rc=$?"
  cut -c1-1500 "$RESULTS/host-ahead-gap-128k.txt"
fi

if [ "$PART" = index ]; then
  gpu_tests index 240 packages/fpv2-index/tests -m gpu
fi
