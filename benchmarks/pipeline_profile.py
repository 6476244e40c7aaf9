"""Per-kernel GPU time of one sparse prefill pipeline call, under ``torch.profiler``.

``fpv2 bench`` splits a call into index / correction plan / attention by CUDA events,
which include the host's launch gaps. This script answers the next question: which
kernels make each stage, how long each runs on the GPU, and how much of the stage is
host time. For each ``--seqlen`` it builds the planted workload, warms the pipeline up,
then profiles ``--repeats`` calls and prints (and writes as JSON) the mean GPU time per
call of every kernel, the sum, and the mean wall time per call; then the host side (issue time,
syncs, cProfile). ``--marks-only`` instead times, without the profiler in the process, when the
host issued each launch and when the GPU got past it (:func:`host_marks`): the profiler's own
timeline is no guide to host gaps, as its Triton launch hooks slow every launch.
``--host-breakdown`` instead times the host side of each pipeline function of a call (:func:`host_breakdown`);
``--cprofile`` runs only :func:`host_side` (no torch.profiler in the process, whose Triton launch hooks would turn
the direct relaunches off).

Usage (the four packages' ``src`` on ``PYTHONPATH``, on a GPU):
``python benchmarks/pipeline_profile.py --seqlen 32768 131072 --page-size 128 --out OUT``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline
from fpv2.serving.soak import SYNC_WARNING


def kernel_times(prof: profile, calls: int) -> dict[str, float]:
    """Mean GPU milliseconds per call of each kernel name (device events only)."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / 1000.0  # us -> ms
    return {name: ms / calls for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])}


def profile_length(seqlen: int, args: argparse.Namespace) -> dict[str, object]:
    """Profile the pipeline at one length; returns the record written to the JSON."""
    wl = planted_workload(
        [seqlen] * args.batch,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=args.head_dim,
        page_size=args.page_size,
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
        seed=args.seed,
    )
    record: dict[str, object] = {"L": seqlen, "B": args.batch, "page_size": args.page_size, "d": args.head_dim}
    for correction in (True, False):
        pipe = SparsePrefillPipeline(SelectionConfig(alpha=args.alpha), correction=correction, backend=args.backend)
        for _ in range(args.warmup):
            pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
        torch.cuda.synchronize()
        key = "corrected" if correction else "uncorrected"
        if args.host_breakdown:
            rows = host_breakdown(lambda: pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch), args.repeats)  # noqa: B023
            record[key] = {"host_breakdown_us": rows}
            print(f"\n== L={seqlen} B={args.batch} page {args.page_size} {key}: host time per call (median us, calls)")
            for name, us, n in rows:
                print(f"    {name:60s} {us:8.1f}  x{n:g}")
            continue
        if args.cprofile:  # the host side alone (issue time, syncs, cProfile), no torch.profiler in the process
            host_ms, syncs, top = host_side(lambda: pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch), args.repeats)  # noqa: B023
            record[key] = {"host_issue_ms": host_ms, "host_syncs_per_call": syncs, "host_profile_top": top}
            print(f"\n== L={seqlen} B={args.batch} page {args.page_size} {key}: host issue {host_ms:.3f} ms/call, "
                  f"{syncs} syncs/call")  # fmt: skip
            print(top)
            continue
        if args.marks_only:  # no profiler in this process: its launch hooks would slow every Triton launch
            record[key] = {}
            for spin in (False, True):
                marks = host_marks(lambda: pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch), args.repeats, spin)  # noqa: B023
                record[key]["host_marks_spin" if spin else "host_marks"] = marks
                print(
                    f"\n== L={seqlen} B={args.batch} page {args.page_size} {key}, waited by "
                    f"{'polling' if spin else 'synchronize'}: host marks (median ms after the call's start: "
                    "host issued, GPU past it)"
                )
                for label, host_ms, gpu_ms in marks:
                    print(f"    {label:28s} host {host_ms:7.3f}  GPU {gpu_ms:7.3f}")
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - t0) * 1000.0 / args.repeats
        kernels = kernel_times(prof, args.repeats)
        host_ms, syncs, top = host_side(lambda: pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch), args.repeats)  # noqa: B023
        record[key] = {
            "wall_ms": wall_ms,
            "gpu_sum_ms": sum(kernels.values()),
            "kernels_ms": kernels,
            "host_issue_ms": host_ms,
            "host_syncs_per_call": syncs,
            "host_profile_top": top,
        }
        print(
            f"\n== L={seqlen} B={args.batch} page {args.page_size} {key}: wall {wall_ms:.3f} ms/call, "
            f"GPU sum {sum(kernels.values()):.3f} ms/call, host issue {host_ms:.3f} ms/call, {syncs} syncs/call"
        )
        for name, ms in kernels.items():
            print(f"  {ms:8.3f}  {name[:110]}")
        print(top)
    return record


#: Functions whose return is marked by ``host_marks``: (module, attribute, label).
_MARKED = (
    ("fpv2.index.triton.api", "launch_pool", "pool launched"),
    ("fpv2.index.triton.api", "launch_score_select", "scoring launched"),
    ("fpv2.index.triton.api", "_launch_hopper_scoring", "Hopper scoring launched"),
    ("fpv2.index.triton.api", "launch_compact", "compaction launched"),
    ("fpv2.kernel.triton.tile_repack", "repack_to_tile_pages", "repack launched"),
    ("fpv2.kernel._native", "hopper_prefill", "attention launched"),
)


def host_marks(call, repeats: int, spin: bool = False) -> list[tuple[str, float, float]]:
    """When the host issued each launch and when the GPU got past it, without the profiler.

    The profiler's timeline is distorted (its Triton launch hooks send every launch through
    ``JITFunction.run``). Here each marked function is wrapped: on its return the host time
    (``perf_counter``) is taken and a CUDA event recorded; a start event and time open the call,
    which starts on an idle GPU like a ``fpv2 bench`` sample. Rows: ``(label, host ms, GPU ms)``
    after the start, medians of ``repeats`` calls; a GPU time well after the host time of the
    next launch means the GPU waited for that launch. ``spin``: the host waits for the GPU (before
    and after each call) by polling an event instead of sleeping in a blocking synchronize, to see
    whether a host thread woken from that sleep issues the next call more slowly.
    """

    def wait(event: torch.cuda.Event) -> None:
        if spin:
            while not event.query():
                pass
        else:
            event.synchronize()

    import importlib
    from unittest import mock

    samples: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for _ in range(repeats):
        marks: list[tuple[str, float, torch.cuda.Event]] = []

        def wrap(fn, label, marks=marks):
            def marked(*a, **k):
                out = fn(*a, **k)
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append((label, time.perf_counter(), event))
                return out

            return marked

        patches = [
            mock.patch.object(importlib.import_module(m), name, wrap(getattr(importlib.import_module(m), name), label))
            for m, name, label in _MARKED
        ]
        for patch in patches:
            patch.start()
        try:
            idle = torch.cuda.Event()
            idle.record()
            wait(idle)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            call()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            marks.append(("call returned / GPU done", time.perf_counter(), end))
            wait(end)
        finally:
            for patch in patches:
                patch.stop()
        for label, host, event in marks:
            samples[label].append(((host - t0) * 1000.0, start.elapsed_time(event)))
    rows = []
    for label, values in samples.items():
        hosts, gpus = sorted(v[0] for v in values), sorted(v[1] for v in values)
        rows.append((label, hosts[len(hosts) // 2], gpus[len(gpus) // 2]))
    return rows


#: Host functions timed by ``host_breakdown``: ``module:attribute`` where the caller looks them up.
_BROKEN_DOWN = (
    "fpv2.serving.pipeline:validate_prefill_inputs",
    "fpv2.serving.timing:StageClock.mark",
    "fpv2.serving.pipeline:SparsePrefillPipeline._tile_copies",
    "fpv2.serving.backends:HopperBackend.tile_copies_for",
    "fpv2.serving.backends:HopperBackend.serves",
    "fpv2.kernel.triton.tile_repack:allocate_tile_pages",
    "fpv2.serving.pipeline:_pool_statistics",
    "fpv2.index.triton:pool_blocks_triton",
    "fpv2.serving.pipeline:_build_block_index",
    "fpv2.index.api:validate_prefill_inputs",
    "fpv2.index.triton:select_blocks_triton",
    "fpv2.index.triton.api:_check_batch",
    "fpv2.index.triton.api:_check_cache",
    "fpv2.index.triton.api:_check_selection",
    "fpv2.index.triton.api:fresh_outputs",
    "fpv2.index.triton.api:capacity_bound",
    "fpv2.index.triton.api:matching_keys",
    "fpv2.index.triton.api:launch_pool",
    "fpv2.index.triton.api:launch_score_select",
    "fpv2.index.triton.api:_launch_hopper_scoring",
    "fpv2.index.triton.api:_launch_triton_scoring",
    "fpv2.index.triton.api:use_hopper_scoring",
    "fpv2.kernel._native.score:score_args_struct",
    "fpv2.kernel._native.score:score_blocks",
    "fpv2.index.triton.api:launch_compact",
    "fpv2.index.triton.api:IndexWorkspace.num_programs",
    "fpv2.index.triton.api:IndexWorkspace.reserve",
    "fpv2.kernel.contracts:BlockIndex.assume_compatible",
    "fpv2.serving.pipeline:build_correction_plan",
    "fpv2.serving.backends:HopperBackend.run",
    "fpv2.serving.backends:HopperBackend._copies",
    "fpv2.kernel.triton.tile_repack:repack_to_tile_pages",
    "fpv2.serving.fallback_backend:FallbackBackend._choose",
    "fpv2.kernel._native:hopper_prefill",
    "fpv2.kernel._native.api:load_native_library",
    "fpv2.kernel._native.api:prefill_args_struct",
    "fpv2.kernel._native.structs:paged_batch_struct",
    "fpv2.kernel._native.structs:block_index_struct",
    "fpv2.kernel._native.structs:correction_plan_struct",
    "fpv2.kernel._native.api:check_status",
)


def host_breakdown(call, repeats: int) -> list[tuple[str, float, float]]:
    """Inclusive host time of each function in ``_BROKEN_DOWN`` per call: ``(name, median us, calls per call)``.

    Each function is wrapped where its caller looks it up (a wrapper adds ~1 us to what it wraps);
    every call starts on an idle GPU. ``fpv2.kernel._native.api:check_status`` wraps only the
    status check, so the C call itself is ``hopper_prefill`` minus ``prefill_args_struct`` and the rest.
    """
    import importlib
    from unittest import mock

    spent: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)

    def wrap(fn, name):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
                counts[name] += 1

        return timed

    patches = []
    for spec in _BROKEN_DOWN:
        module, attr = spec.split(":")
        owner = importlib.import_module(module)
        *path, leaf = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        patches.append(mock.patch.object(owner, leaf, wrap(getattr(owner, leaf), spec)))
    per_call: dict[str, list[float]] = defaultdict(list)
    calls: dict[str, int] = defaultdict(int)
    for patch in patches:
        patch.start()
    try:
        total = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            spent.clear()
            counts.clear()
            t0 = time.perf_counter()
            call()
            total.append((time.perf_counter() - t0) * 1e6)
            for name in _BROKEN_DOWN:
                per_call[name].append(spent.get(name, 0.0) * 1e6)
                calls[name] = counts.get(name, 0)
        torch.cuda.synchronize()
    finally:
        for patch in patches:
            patch.stop()
    rows = [("whole call", sorted(total)[len(total) // 2], 1.0)]
    for name in _BROKEN_DOWN:
        values = sorted(per_call[name])
        rows.append((name, values[len(values) // 2], float(calls[name])))
    return rows


def host_side(call, repeats: int) -> tuple[float, int, str]:
    """Host cost of a call started on an idle GPU: median issue ms, host syncs per call, cProfile top 40 twice.

    The issue time is how long the call takes to return (everything launched); a sync inside
    it (found with ``torch.cuda.set_sync_debug_mode``) would make it wait for the GPU too.
    """
    issue = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        issue.append((time.perf_counter() - t0) * 1000.0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only torch's sync message counts: the mode's one-time "prototype feature ... synchronizing operations"
    # notice, emitted when it is first set in a process, counted as a sync here before (2026-12-04).
    syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
    profiler = cProfile.Profile()
    for _ in range(repeats):
        torch.cuda.synchronize()
        profiler.enable()
        call()
        profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(40)  # the leaves where the host time is spent
    # What the pooling launch spends its time on (159 us of host inside the pipeline at 128K, 2026-12-04).
    stats.sort_stats("cumulative").print_callees(
        r"launch_pool|pool_blocks_triton|fresh_outputs|relaunch.py.*\(__call__\)"
    )
    return sorted(issue)[len(issue) // 2], syncs, text.getvalue()


def main() -> None:
    """Parse the arguments, profile each length, write ``pipeline-profile.json`` under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("fpv2-results/pipeline-profile"))
    parser.add_argument(
        "--marks-only", action="store_true", help="only the host/GPU launch marks, without the profiler in the process"
    )
    parser.add_argument(
        "--host-breakdown", action="store_true", help="only the host time of each pipeline function (no profiler)"
    )
    parser.add_argument(
        "--cprofile", action="store_true", help="only the host side: issue time, syncs and cProfile (no torch.profiler)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pipeline_profile.py needs a CUDA GPU (it profiles device kernels)")
    records = [profile_length(seqlen, args) for seqlen in args.seqlen]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline-profile.json").write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
