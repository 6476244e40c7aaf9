#!/usr/bin/env bash
# The pooling kernel's launch knobs at 32K and 128K, and the dense 128K call's host wait, from the repository root,
# with a library built on the development machine.
#
#   benchmarks/index_pool_device_run.sh sweep    index_speed.py --sweep at page 1 (the index issue's shape) and at
#                                                page 128 (the bench's), L = 32K and 128K; then the dense-wait probe
#   benchmarks/index_pool_device_run.sh verify   index_speed.py at page 1 (and the pooling sweep again at 32K) and
#                                                fpv2 bench at 32K / 128K (page 128) on the chosen knobs
#   benchmarks/index_pool_device_run.sh checks   the index and serving GPU tests (soak included) and the eager
#                                                pipeline's launch marks at 32K / 128K (where the GPU waits)
#   benchmarks/index_pool_device_run.sh dense-wait  only the probe: host time, syncs and allocator calls of one dense
#                                                128K pipeline call behind a 400 ms spin
#
# Prediction (written before the first run): at 32K the pooling kernel runs 256 programs of 8 heads (two per SM),
# each walking its 128 tokens 8 at a time, so it is latency-bound: 74 us against a 28 us read floor (page 1),
# while 128K (1024 programs) runs at 131 us against 112. Fewer heads per program (more programs) or more tokens a
# step should bring 32K to 35-45 us and leave 128K within +-5%; the index's graph time at 32K, page 1, would go
# from 0.268 to 0.23-0.24 ms (target 0.25).
# Measured (sweep): 32K page 1 0.082 -> 0.057 ms with 4 tokens a step (128K 0.142 -> 0.136), page 128 slower with 4
# (0.044 -> 0.063): the knob is now per page size (PoolTuning.gather_tokens). The dense 128K call issued in 6-18 ms
# with no sync and no allocator call: the 64 ms cap on the host-ahead spin gave up on it (now 1000 ms).
# Prediction (verify): index graph time at 32K, page 1 0.255 -> 0.23 ms, 128K within +-1%; the bench's rows (page
# 128, 8 tokens a step as before) unchanged, and its dense 128K row gets a host-ahead time (about 210 ms).
#
# Environment: IP_BIN folder with libfpv2_kernel.so [build/kernel]; FPV2_COMMIT (recorded by fpv2 bench); OUT;
# outputs go to $OUT/index-pool-<part>/ and logs are packed into $OUT/index-pool-<part>.tgz.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start index-pool "${1:-sweep}" "${IP_BIN:-build/kernel}"
RESULTS="$OUT/index-pool-$PART"
mkdir -p "$RESULTS" || exit 1

# index_speed.py at one page size: index_speed PAGE NAME LIMIT [extra args]
index_speed() {
  local page="$1" name="$2" limit="$3"
  shift 3
  with_packages timeout "$limit" python3 benchmarks/index_speed.py --seqlens 32768 131072 --page-size "$page" \
    --out "$RESULTS/$name" "$@" > "$LOGS/$name.log" 2>&1
  echo "index_speed page $page ($name): rc=$?"
  grep -E "^\| |^floor|x1 " "$LOGS/$name.log" | cut -c1-150
}

dense_wait() {
  with_packages timeout 120 python3 - > "$LOGS/dense-wait.log" 2>&1 <<'EOF'
import json, time, torch
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline
from fpv2.serving.soak import SyncCounter
from fpv2.serving.timing import spin_cycles_per_ms

w = planted_workload([131072], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=128, dtype=torch.bfloat16,
                     device=torch.device("cuda"), seed=0)
pipe = SparsePrefillPipeline(strategy="dense", correction=False)
cycles = spin_cycles_per_ms(torch.device("cuda"))
for _ in range(2):
    pipe(w.q, w.k_cache, w.v_cache, w.batch)
torch.cuda.synchronize()
keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
rows = []
for spin_ms in (400.0, 400.0, 400.0):
    before = {k: torch.cuda.memory_stats().get(k) for k in keys}
    with SyncCounter() as counter:
        counter.reset()
        t0 = time.perf_counter()
        torch.cuda._sleep(int(spin_ms * cycles))
        t1 = time.perf_counter()
        result = pipe(w.q, w.k_cache, w.v_cache, w.batch)
        host_ms = (time.perf_counter() - t0) * 1e3
        syncs, sites = counter.take()
    torch.cuda.synchronize()
    after = {k: torch.cuda.memory_stats().get(k) for k in keys}
    rows.append({"spin_ms": spin_ms, "spin_issue_ms": (t1 - t0) * 1e3, "host_ms": host_ms, "syncs": syncs,
                 "sync_sites": dict(sites), "allocator": {k: (after[k] or 0) - (before[k] or 0) for k in keys}})
    del result
    print(json.dumps(rows[-1]), flush=True)
EOF
  echo "dense-wait: rc=$?"
  cut -c1-400 "$LOGS/dense-wait.log"
  cp "$LOGS/dense-wait.log" "$RESULTS/dense-wait.jsonl"
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > "$LOGS/gpu.txt" 2>&1
if [ "$PART" = sweep ]; then
  index_speed 1 page1 230 --sweep --sweep-kernels pool --sweep-seqlens 32768 131072 --probes 2 --error-seqlens
  index_speed 128 page128 150 --sweep --sweep-kernels pool --sweep-seqlens 32768 131072 --probes --error-seqlens --no-host-profile
  dense_wait
elif [ "$PART" = verify ]; then
  index_speed 1 page1 200 --probes 2 4 8 --sweep --sweep-kernels pool --sweep-seqlens 32768
  bench_row 1 32768 bench-32768 150
  bench_row 1 131072 bench-131072 150
elif [ "$PART" = checks ]; then
  # The index package's GPU tests on the new pooling step, then where an eager pipeline call leaves the GPU idle
  # (host issue vs GPU progress of each launch, pipeline_profile.py --marks-only), then the serving GPU tests.
  with_packages timeout 150 python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" packages/fpv2-index/tests \
    -rf > "$LOGS/pytest-gpu-index.log" 2>&1
  echo "pytest gpu index: rc=$? $(tail -1 "$LOGS/pytest-gpu-index.log")"
  grep -E "^(FAILED|ERROR)" "$LOGS/pytest-gpu-index.log" | head
  with_packages timeout 150 python3 benchmarks/pipeline_profile.py --marks-only --seqlen 32768 131072 \
    --page-size 128 --out "$RESULTS/marks" > "$LOGS/marks.log" 2>&1
  echo "marks: rc=$?"
  grep -v Warning "$LOGS/marks.log" | tail -30 | cut -c1-160
  with_packages timeout 250 python3 -m pytest -p no:cacheprovider -q -m "gpu or hopper" packages/fpv2-serving/tests \
    --durations=8 -rf > "$LOGS/pytest-gpu-serving.log" 2>&1
  echo "pytest gpu serving (soak included): rc=$?"
  grep -E "passed|failed|^FAILED|^ERROR|s call" "$LOGS/pytest-gpu-serving.log" | head -20 | cut -c1-200
elif [ "$PART" = dense-wait ]; then
  dense_wait
else
  echo "usage: $0 sweep|verify|checks|dense-wait" >&2
  exit 2
fi
