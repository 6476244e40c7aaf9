"""Whether the Hopper attention kernel runs slower in an eager pipeline call than with the host ahead.

``fpv2 bench`` at 128K, page 1, puts 0.5 ms more in the eager attention stage than in the host-ahead one
(2026-12-05, H100: 11.67 against 11.15 ms), and the launch marks of an eager call show the attention launch
queued long before the GPU reaches it, so the excess is not the host's. This script times the same attention
launch (the pipeline's own, replayed with its index, plan and tile-page copies) under four protocols, each
sample on its own, the protocols interleaved round by round:

- ``ahead``: ``--calls`` launches back to back between two CUDA events (the bench's host-ahead figure);
- ``eager``: one launch between two events after a synchronize (the GPU idle a few microseconds before it);
- ``idle``: the same after the GPU sat idle ``--idle-ms`` (what an eager bench sample starts with);
- ``pipeline``: a whole eager pipeline call, the events around the attention launch only (recorded before the
  backend's host work, so the host's share shows too).

With the SM clock (NVML, else nvidia-smi) read before and after each sample. Prints one JSON line per
protocol (medians, minima, the clocks) and writes them to ``--out``.

Usage (the four packages' ``src`` on ``PYTHONPATH``, on an sm90 GPU):
``python benchmarks/eager_attention_probe.py --seqlen 131072 --out fpv2-results/eager-attention.jsonl``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from attention_switch_probe import captured_launch, timed  # this folder, first on sys.path when run as a script

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.environment import gpu_clock_state
from fpv2.serving.pipeline import SparsePrefillPipeline

PROTOCOLS = ("ahead", "eager", "idle", "pipeline")


def attention_in_pipeline(pipe: SparsePrefillPipeline, workload) -> float:
    """Milliseconds between events recorded just before and just after the attention launch of one eager call."""
    backend = pipe.backend
    run = backend.run
    events: list[torch.cuda.Event] = []

    def bracketed_run(*args, **kwargs):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        out = run(*args, **kwargs)
        after.record()
        events.extend((before, after))
        return out

    backend.run = bracketed_run
    try:
        torch.cuda.synchronize()
        pipe(workload.q, workload.k_cache, workload.v_cache, workload.batch)
        torch.cuda.synchronize()
    finally:
        backend.run = run
    return events[0].elapsed_time(events[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--no-correction", action="store_true", help="time the uncorrected attention")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=5, help="launches per `ahead` sample")
    parser.add_argument("--idle-ms", type=float, default=5.0, help="GPU idle time before an `idle` sample")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file to append the results to")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("eager_attention_probe needs a CUDA GPU (the Hopper backend)")
    device = torch.device("cuda")
    shape = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": args.page_size}
    wl = planted_workload([args.seqlen], **shape, dtype=torch.bfloat16, device=device)
    pipe = SparsePrefillPipeline(SelectionConfig(alpha=args.alpha), correction=not args.no_correction, backend="hopper")
    launch = captured_launch(pipe, wl)
    for _ in range(3):
        timed(launch, args.calls)
    samples: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
    clocks: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
    for _ in range(args.rounds):
        for protocol in PROTOCOLS:
            torch.cuda.synchronize()
            if protocol == "idle":
                time.sleep(args.idle_ms / 1000.0)
            before = gpu_clock_state(device)
            if protocol == "ahead":
                ms = timed(launch, args.calls)
            elif protocol == "pipeline":
                ms = attention_in_pipeline(pipe, wl)
            else:
                ms = timed(launch, 1)
            after = gpu_clock_state(device)
            samples[protocol].append(ms)
            clocks[protocol].extend(c["sm_mhz"] for c in (before, after) if c is not None)
    lines = []
    for protocol in PROTOCOLS:
        line = {
            "protocol": protocol, "seqlen": args.seqlen, "page_size": args.page_size, "alpha": args.alpha,
            "correction": not args.no_correction, "rounds": args.rounds, "idle_ms": args.idle_ms,
            "median_ms": round(statistics.median(samples[protocol]), 4),
            "min_ms": round(min(samples[protocol]), 4),
            "sm_mhz_median": statistics.median(clocks[protocol]) if clocks[protocol] else None,
            "sm_mhz_min": min(clocks[protocol]) if clocks[protocol] else None,
            "gpu": torch.cuda.get_device_name(device),
        }  # fmt: skip
        lines.append(json.dumps(line))
        print(lines[-1], flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
