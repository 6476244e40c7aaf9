#!/usr/bin/env bash
# GPU time of a pipeline call with the host ahead (fpv2 bench's gpu_ms columns, fpv2.serving.timing.host_ahead_call)
# beside the eager per-call time, from the repository root, with a library built on the development machine.
#
#   benchmarks/gpu_time_device_run.sh bench   fpv2 bench, planted, alpha 0.1, page 128: B=1 at 32K and 128K, then
#                                             4 x 128K; each row eager (ms) and host-ahead (gpu_ms)
#   benchmarks/gpu_time_device_run.sh pipeline  B=1 bench rows, index_speed.py, the serving GPU tests without the soak
#   benchmarks/gpu_time_device_run.sh dense   B=1 bench rows again (dense pipeline fixed), serving GPU tests with durations
#   benchmarks/gpu_time_device_run.sh index   benchmarks/index_speed.py at page 1 (the index issue's shape): events,
#                                             CUDA graph, host issue time, per-kernel profile, cProfile of the host
#
# Prediction (written before the first run): the eager time counts the host time the idle GPU waits for, measured
# at 0.45 ms (32K) and 0.55 ms (128K) of a corrected call (2026-12-01 timeline); with the host ahead the 128K call
# should read 13.0-13.2 ms (eager 13.6), the 32K call 1.8-1.9 ms (eager 2.1-2.3), the index stage 1.7-1.8 ms at
# 128K and 0.22-0.27 ms at 32K (graph replay of the index alone: 1.73 and 0.263); the attention stage within +-2%
# of its eager figure (one launch, already GPU-bound); SDPA rows within +-1%.
#
# Environment: GT_BIN folder with libfpv2_kernel.so [build/kernel]; FPV2_COMMIT (recorded by fpv2 bench: the device
# copy has no git); OUT; outputs go to $OUT/gpu-time-<part>/ and logs are packed into $OUT/gpu-time-<part>.tgz.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start gpu-time "${1:-bench}" "${GT_BIN:-build/kernel}"
RESULTS="$OUT/gpu-time-$PART"
mkdir -p "$RESULTS" || exit 1

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$LOGS/gpu.txt" 2>&1
if [ "$PART" = bench ]; then
  bench_row 1 32768 bench-32768 120
  bench_row 1 131072 bench-131072 150
  bench_row 4 131072 bench-4x131072 260
elif [ "$PART" = pipeline ]; then
  # B=1 bench rows (the dense row's index without a host sync since this part was added), the index at page 1,
  # then the serving GPU tests but the soak ones (bench's host-ahead columns, the dense pipeline's zero syncs).
  bench_row 1 32768 bench-32768 80
  bench_row 1 131072 bench-131072 130
  with_packages timeout 150 python3 benchmarks/index_speed.py --seqlens 32768 131072 --out "$RESULTS/index-speed" \
    > "$LOGS/index-speed.log" 2>&1
  echo "index_speed: rc=$?"
  grep -v "^note\|Warning" "$LOGS/index-speed.log" | tail -45 | cut -c1-150
  with_packages timeout 200 python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" packages/fpv2-serving/tests \
    --deselect packages/fpv2-serving/tests/test_soak.py > "$LOGS/pytest-gpu-serving.log" 2>&1
  echo "pytest gpu serving (no soak): rc=$? $(tail -1 "$LOGS/pytest-gpu-serving.log")"
  grep -E "^(FAILED|ERROR)" "$LOGS/pytest-gpu-serving.log" | head
elif [ "$PART" = dense ]; then
  # The B=1 rows again after the dense pipeline stopped pooling through the reference, then the serving GPU tests
  # (no soak) with their durations.
  bench_row 1 32768 bench-32768 80
  bench_row 1 131072 bench-131072 120
  with_packages timeout 300 python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" packages/fpv2-serving/tests \
    --deselect packages/fpv2-serving/tests/test_soak.py --durations=15 -rf > "$LOGS/pytest-gpu-serving.log" 2>&1
  echo "pytest gpu serving (no soak): rc=$?"
  grep -E "passed|failed|^FAILED|^ERROR|s call" "$LOGS/pytest-gpu-serving.log" | head -30 | cut -c1-200
elif [ "$PART" = index ]; then
  with_packages timeout 200 python3 benchmarks/index_speed.py --seqlens 32768 131072 --out "$RESULTS/index-speed" \
    > "$LOGS/index-speed.log" 2>&1
  echo "index_speed: rc=$?"
  tail -40 "$LOGS/index-speed.log" | cut -c1-170
else
  echo "usage: $0 bench|pipeline|dense|index" >&2
  exit 2
fi
