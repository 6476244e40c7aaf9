"""Where a host-ahead pipeline call's GPU time goes beyond its kernels' durations.

``fpv2 bench``'s ``gpu_ms`` (:func:`fpv2.serving.timing.host_ahead_call`: a spin holds the stream while the host
issues the call, then two events time it) read 13.23-13.30 ms at 128K on an H200 in the 32nd session, while
``pipeline_profile.py`` summed the same call's kernels to 12.94 ms (eager calls, torch.profiler). This probe runs
both views on the same calls. It alternates plain host-ahead calls (the bench's number) with host-ahead calls
under ``torch.profiler``. From the profiled calls it reads the kernels' start and end times between the spin's end
and the last kernel: the sum of the kernels' durations, the idle time between them (and before the first), and
the span.

Usage (the four packages' ``src`` on ``PYTHONPATH``, ``FPV2_KERNEL_LIBRARY`` set, on an sm90 GPU):
``python benchmarks/host_ahead_gap_probe.py --seqlen 131072 --rounds 8 --out OUT.json``
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline
from fpv2.serving.timing import HOST_AHEAD_MIN_LEAD_MS, host_ahead_call, spin_cycles_per_ms


def kernel_intervals(prof: profile) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel the profiler saw, in start order."""
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            spans.append((event.name, float(event.time_range.start), float(event.time_range.end)))
    return sorted(spans, key=lambda span: span[1])


def call_breakdown(spans: list[tuple[str, float, float]]) -> dict[str, object]:
    """Kernel sum, gaps and span of the call's kernels: everything after the last spin kernel."""
    spins = [i for i, (name, _, _) in enumerate(spans) if "spin" in name or "sleep" in name]
    if not spins:
        raise RuntimeError(f"no spin kernel among the profiled kernels: {[name[:40] for name, _, _ in spans]}")
    spin = spins[-1]  # a redone call has several: the last one precedes the call that counted
    call = spans[spin + 1 :]
    gaps = [max(0.0, b[1] - a[2]) for a, b in itertools.pairwise(call)]
    return {
        "spin_kernel": spans[spin][0][:60],
        "kernels": [(name[:70], round((end - start) / 1e3, 4)) for name, start, end in call],
        "kernel_sum_ms": sum(end - start for _, start, end in call) / 1e3,
        "lead_in_ms": (call[0][1] - spans[spin][2]) / 1e3 if call else None,
        "gaps_ms": round(sum(gaps) / 1e3, 4),
        "largest_gap_ms": round(max(gaps, default=0.0) / 1e3, 4),
        "span_ms": (call[-1][2] - spans[spin][2]) / 1e3 if call else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_ahead_gap_probe needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    wl = planted_workload([args.seqlen] * args.batch, num_q_heads=32, num_kv_heads=8, head_dim=128,
                          page_size=args.page_size, dtype=torch.bfloat16, device=device)  # fmt: skip
    pipe = SparsePrefillPipeline(SelectionConfig(alpha=0.1), correction=True, backend="hopper")

    def call() -> object:
        return pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    cycles = spin_cycles_per_ms(device)
    lead = HOST_AHEAD_MIN_LEAD_MS
    plain, profiled = [], []
    for _ in range(args.rounds):
        ms, _, lead = host_ahead_call(call, device, cycles, lead)
        plain.append(ms)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ms, _, lead = host_ahead_call(call, device, cycles, max(lead, 4 * HOST_AHEAD_MIN_LEAD_MS))
        record = call_breakdown(kernel_intervals(prof))
        record["events_ms"] = ms
        profiled.append(record)
    summary = {
        "seqlen": args.seqlen, "batch": args.batch, "gpu": torch.cuda.get_device_name(device),
        "plain_events_ms": plain,
        "plain_median_ms": statistics.median([m for m in plain if m is not None]),
        "profiled_median": {key: statistics.median([r[key] for r in profiled if r[key] is not None])
                            for key in ("events_ms", "kernel_sum_ms", "lead_in_ms", "gaps_ms", "span_ms")},
        "profiled": profiled,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in summary.items() if k != "profiled"}))
    print("one profiled call:", json.dumps(profiled[-1]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
