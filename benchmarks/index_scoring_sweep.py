"""Scoring-kernel variants of the Triton index stage: kernel time, index time, identity with the default.

For each ``--seqlens`` L (B=1, the planted workload of ``benchmarks/index_speed.py``
with its default shape, fraction, margin and seed) and each variant (knob
overrides of :class:`fpv2.index.triton.tuning.ScoreTuning`, see ``--list``),
in one process:

- ``score_ms``: the fused scoring/selection kernel alone: its launch, recorded
  from one ``select_blocks_triton`` call, replayed ``--launches`` times back to back
  between two CUDA events (GPU-bound: the host issues a relaunch in ~10 us), per
  launch, median of ``--repeats`` such samples after ``--warmup``;
- ``index_ms`` (pool + select, CUDA events), ``index_graph_ms`` (the same replayed
  as a CUDA graph: GPU only), ``index_host_ms``, ``pool_ms``, ``select_ms`` and
  the per-kernel profile, from ``index_speed.measure_index``;
- ``pairs_differing_from_default`` / ``identical_to_default``: the variant's index
  against the default knobs' index (same offsets and blocks);
- ``score_kernel``: registers, spills, shared memory and resident programs per SM
  of the variant's compiled scoring kernel.

The default runs first and again last (``default/again``: the run-to-run spread).
All scoring kernels of an L are compiled up front in parallel (Triton's
``AsyncCompileMode``), so compiles do not dominate the run. Writes
``index-scoring-sweep.json`` under ``--out`` (rewritten after each L) and prints a
table. ``--device cpu`` with ``TRITON_INTERPRET=1`` and small ``--seqlens`` checks
the plumbing (its times mean nothing).

Example (about 2 minutes on one H200, mostly compiling 17 scoring kernels per L)::

    python benchmarks/index_scoring_sweep.py --out benchmarks/results/index-scoring-sweep
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import index_speed  # the planted workload's defaults, timing, identity and kernel-report helpers
import torch

from fpv2.index import SelectionConfig
from fpv2.index import triton as index_triton
from fpv2.index.triton import interpreter_enabled, scoring, tuning
from fpv2.kernel.contracts import BlockIndex
from fpv2.kernel.testing import planted_workload
from fpv2.serving.environment import environment_record, git_commit, gpu_name
from fpv2.serving.report import write_json
from fpv2.serving.timing import benchmark_device, median, protocol_notes, timed_samples

#: Knobs every "exact" combination sets: the bit-identical variants together.
EXACT = {"mma_store": True, "light_tail": True, "tree_max": True, "snake_order": True, "const_group": True}
#: The variants, by label: knob overrides of the default ``ScoreTuning`` (the first is the identity reference).
VARIANTS: dict[str, dict[str, object]] = {
    "default": {},
    "mma": {"mma_store": True},
    "light": {"light_tail": True},
    "tree": {"tree_max": True},
    "snake": {"snake_order": True},
    "group": {"const_group": True},
    "prefetch+mma": {"key_prefetch": True, "mma_store": True},
    "qprefetch": {"q_prefetch": True},
    "poly1": {"poly_exp2": 1},
    "exact": dict(EXACT),
    "exact+prefetch": {**EXACT, "key_prefetch": True},
    "exact+qprefetch": {**EXACT, "q_prefetch": True},
    "exact+prefetch+qprefetch": {**EXACT, "key_prefetch": True, "q_prefetch": True},
    "exact+poly1": {**EXACT, "poly_exp2": 1},
    "exact+prefetch+qprefetch+poly1": {**EXACT, "key_prefetch": True, "q_prefetch": True, "poly_exp2": 1},
    "exact+pair": {**EXACT, "tiles_per_program": 2},
    "exact+pair+qprefetch+poly1": {**EXACT, "tiles_per_program": 2, "q_prefetch": True, "poly_exp2": 1},
    # Tile shapes and pipeline depth, for head dims the defaults were not measured at (d = 256).
    "exact+bn128": {**EXACT, "block_n": 128},
    "exact+bn128+w8": {**EXACT, "block_n": 128, "num_warps": 8},
    "exact+stages3": {**EXACT, "num_stages": 3},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; workload defaults are ``index_speed.py``'s.

    Args:
        argv: arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    base = index_speed.parse_args(["--out", "unused"])  # its defaults: one definition of the planted workload
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072], help="L values (default 32768 131072)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="variant labels (see --list)")
    p.add_argument("--list", action="store_true", help="print the variants and their knobs, then exit")
    for name in ("q_heads", "kv_heads", "head_dim", "page_size", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(base, name))
    p.add_argument("--dtype", choices=sorted(index_speed.DTYPES), default=base.dtype)
    p.add_argument("--alpha", type=float, default=base.alpha)
    p.add_argument("--fraction", type=float, default=base.fraction, help="planted fraction of key blocks")
    p.add_argument("--margin", type=float, default=base.margin, help="planted logit margin")
    p.add_argument("--probe", type=int, default=1, help="probe stride of the selection (1: full rows)")
    p.add_argument("--repeats", type=int, default=15, help="timed samples per measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before each measurement")
    p.add_argument("--launches", type=int, default=10, help="back-to-back kernel launches per score_ms sample")
    p.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile of the index call")
    p.add_argument("--no-precompile", action="store_true", help="compile each variant on first use instead")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=None, help="folder for index-scoring-sweep.json (required to run)")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if "default" not in args.variants:
        args.variants.insert(0, "default")  # the identity reference
    else:
        args.variants.remove("default")
        args.variants.insert(0, "default")
    if not args.list and args.out is None:
        p.error("--out is required")
    if min(args.repeats, args.launches, args.probe) < 1 or args.warmup < 0 or min(args.seqlens) < 1:
        p.error("--repeats, --launches, --probe and --seqlens must be >= 1, --warmup >= 0")
    args.no_host_profile = True  # index_speed.measure_index reads these
    return args


class _Recorded(Exception):
    """Raised by :class:`_Recorder` in place of a launch (precompilation)."""


class _Recorder:
    """Stands in for the scoring kernel's launcher (``scoring._SCORE_SELECT``) during one selection call.

    ``mode="record"`` launches through the real launcher and keeps the launch (grid, arguments, constexprs)
    for replays; ``mode="warmup"`` compiles it with ``JITFunction.warmup`` (asynchronously under an
    ``AsyncCompileMode``) and raises :class:`_Recorded` instead of launching.
    """

    def __init__(self, real: object, mode: str) -> None:
        self.real = real
        self.mode = mode
        self.launch: tuple | None = None

    def __call__(self, grid, *args, **meta) -> None:
        self.launch = (grid, args, meta)
        if self.mode == "warmup":
            scoring._score_select_kernel.warmup(*args, grid=grid, **meta)
            raise _Recorded
        self.real(grid, *args, **meta)


def with_knobs(overrides: dict[str, object], fn):
    """Run ``fn()`` with the default scoring knobs plus ``overrides``, restoring the previous knobs."""
    previous = tuning.set_tuning(score=replace(tuning.ScoreTuning(), **overrides))
    try:
        return fn()
    finally:
        tuning.set_tuning(score=previous[0])


def record_launch(w, stats, config: SelectionConfig, mode: str) -> tuple:
    """The scoring kernel's launch ``(grid, args, meta)`` of one selection with the current knobs.

    With ``mode="record"`` the selection runs (a fresh workspace, returned too, keeps the launch's scratch
    alive); with ``"warmup"`` it only compiles the kernel.
    """
    recorder = _Recorder(scoring._SCORE_SELECT, mode)
    workspace = index_triton.IndexWorkspace(w.q.device)
    scoring._SCORE_SELECT = recorder
    try:
        index = index_triton.select_blocks_triton(w.q, w.batch, stats, config=config, workspace=workspace)
    except _Recorded:
        index = None
    finally:
        scoring._SCORE_SELECT = recorder.real
    return recorder.launch, workspace, index


def precompile(w, stats, config: SelectionConfig, labels: list[str], log) -> None:
    """Compile the scoring kernel of every variant in parallel (Triton ``AsyncCompileMode``); best effort."""
    try:
        from triton import AsyncCompileMode
    except ImportError:
        log("note: this Triton has no AsyncCompileMode; compiling each variant on first use")
        return
    t0 = time.perf_counter()
    workers = max(1, min(len(labels), os.cpu_count() or 1))
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool):
            for label in labels:
                with_knobs(VARIANTS[label], lambda: record_launch(w, stats, config, "warmup"))
    except Exception as exc:  # a diagnostic: the timed calls compile what is missing
        log(f"note: parallel precompilation failed ({type(exc).__name__}: {exc}); compiling on first use")
        return
    log(f"compiled {len(labels)} scoring kernels in {time.perf_counter() - t0:.1f} s ({workers} threads)")


def score_kernel_ms(launch: tuple, args: argparse.Namespace, device: torch.device) -> tuple[float, list[float]]:
    """Per-launch milliseconds of the recorded scoring launch: ``--launches`` relaunches per sample."""
    grid, kernel_args, meta = launch
    launcher = scoring._SCORE_SELECT

    def burst() -> None:
        for _ in range(args.launches):
            launcher(grid, *kernel_args, **meta)

    samples, _ = timed_samples(burst, args.warmup, args.repeats, device)
    per_launch = [s / args.launches for s in samples]
    return median(per_launch), per_launch


def kernel_report(launch: tuple, device: torch.device) -> dict[str, object]:
    """Registers, spills, shared memory and resident programs per SM of the compiled kernel of ``launch``."""
    if device.type != "cuda":
        return {}
    try:
        grid, _, meta = launch
        fn = scoring._score_select_kernel
        names = {p.name for p in fn.params if p.is_constexpr}
        want = {k: v for k, v in meta.items() if k in names}
        for kernel in fn.device_caches[torch.cuda.current_device()][0].values():
            kernel = kernel.result() if hasattr(kernel, "result") else kernel
            consts = {fn.arg_names[k[0]]: v for k, v in kernel.src.constants.items() if len(k) == 1}
            if all(consts.get(k) == v for k, v in want.items()) and kernel.metadata.num_stages == meta["num_stages"]:
                kernel._init_handles()
                threads = 32 * kernel.metadata.num_warps
                return {
                    "n_regs": kernel.n_regs,
                    "n_spills": kernel.n_spills,
                    "shared_bytes": kernel.metadata.shared,
                    "num_stages": kernel.metadata.num_stages,
                    "programs_per_sm_resident": index_speed._occupancy(
                        kernel.function, threads, kernel.metadata.shared
                    ),
                    "programs": grid[0],
                }
    except Exception as exc:  # a diagnostic: report, do not fail the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {}


def measure_variant(label: str, w, config: SelectionConfig, args, device, reference: BlockIndex | None, nb: int):
    """One row: the variant's scoring kernel alone, its whole index call, its identity with ``reference``."""
    stats = index_triton.pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=config.block_size)

    def run() -> tuple[dict[str, object], BlockIndex]:
        launch, workspace, _ = record_launch(w, stats, config, "record")
        ms, samples = score_kernel_ms(launch, args, device)
        row, index = index_speed.measure_index(index_triton, label, w, config, args, device, extras=True)
        row.update(score_ms=ms, score_samples_ms=samples, score_kernel=kernel_report(launch, device))
        del workspace
        return row, index

    row, index = with_knobs(VARIANTS[label], run)
    row["variant"] = label
    row["knobs"] = VARIANTS[label]
    if reference is not None:
        row["pairs_differing_from_default"] = index_speed.pair_difference(index, reference, nb)
        row["identical_to_default"] = index_speed.identical(index, reference)
    for p in row.get("profile", []):
        if "score_select" in str(p["kernel"]):
            row["score_profile_us"] = p["us"]
    return row, index


def fmt(value: object, spec: str) -> str:
    """A table cell (``-`` for missing values)."""
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, object]]) -> str:
    """The rows as a markdown table, with each variant's change against the first default of its L."""
    head = (
        "| L | variant | score ms | vs default | index ms | graph ms | host ms | identical | pairs diff | "
        "regs | spills | smem KB | progs/SM |"
    )
    lines = [head, "|" + "---|" * 13]
    base: dict[int, float] = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['L']} | {r['variant']} | error: {r['error']} |" + " |" * 11)
            continue
        base.setdefault(int(r["L"]), float(r["score_ms"]))
        k = r.get("score_kernel") or {}
        change = float(r["score_ms"]) / base[int(r["L"])] - 1
        cells = [
            str(r["L"]),
            str(r["variant"]),
            fmt(r.get("score_ms"), ".3f"),
            f"{change:+.1%}",
            fmt(r.get("index_ms"), ".3f"),
            fmt(r.get("index_graph_ms"), ".3f"),
            fmt(r.get("index_host_ms"), ".3f"),
            str(r.get("identical_to_default", "-")),
            str(r.get("pairs_differing_from_default", "-")),
            str(k.get("n_regs", "-")),
            str(k.get("n_spills", "-")),
            fmt(k["shared_bytes"] / 1024, ".1f") if "shared_bytes" in k else "-",
            str(k.get("programs_per_sm_resident", "-")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``).

    Returns:
        The process exit status.
    """
    args = parse_args(argv)
    if args.list:
        for label, knobs in VARIANTS.items():
            print(f"{label:24s} {knobs}")
        return 0
    try:
        device = benchmark_device(args.device)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)

    notes = protocol_notes(device, args.repeats, "perf_counter times check the plumbing, not benchmark numbers")
    notes.append(
        f"score_ms: the scoring kernel's recorded launch replayed {args.launches} times back to back between CUDA "
        "events, per launch; index_ms: pool_blocks_triton(K, V) + select_blocks_triton (CUDA events), graph: the "
        "same as a CUDA graph replay; identical_to_default: same offsets and blocks as the default knobs' index"
    )
    payload: dict[str, object] = {
        "benchmark": "index_scoring_sweep",
        "commit": git_commit(),
        "gpu": gpu_name(device),
        "environment": environment_record(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "tuning_defaults": vars(tuning.SCORE).copy(),
        "variants": {label: VARIANTS[label] for label in args.variants},
        "workload": "planted",
        "timer": "cuda-events" if device.type == "cuda" else "perf_counter",
        "notes": notes,
        "rows": [],
    }
    rows: list[dict[str, object]] = payload["rows"]  # type: ignore[assignment]
    out = args.out / "index-scoring-sweep.json"
    labels = [*args.variants, "default"]  # the default again last: the run-to-run spread
    for seqlen in args.seqlens:
        log(f"L={seqlen}: building the planted workload")
        w = planted_workload(
            [seqlen],
            num_q_heads=args.q_heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            page_size=args.page_size,
            fraction=args.fraction,
            margin=args.margin,
            dtype=index_speed.DTYPES[args.dtype],
            device=device,
            seed=args.seed,
        )
        config = SelectionConfig(alpha=args.alpha, probe_stride=args.probe)
        nb = -(-seqlen // config.block_size)
        base = {"L": seqlen, "B": 1, "Hq": args.q_heads, "Hkv": args.kv_heads, "d": args.head_dim}
        if not args.no_precompile and not interpreter_enabled() and device.type == "cuda":
            stats = index_triton.pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=config.block_size)
            log(f"L={seqlen}: compiling {len(args.variants)} scoring kernels")
            precompile(w, stats, config, list(args.variants), log)
            del stats
        reference = None
        for i, label in enumerate(labels):
            shown = label if i < len(labels) - 1 else "default/again"
            log(f"L={seqlen}: {shown} ({i + 1}/{len(labels)})")
            try:
                row, index = measure_variant(label, w, config, args, device, reference, nb)
            except Exception as exc:
                log(f"L={seqlen} {shown} failed: {type(exc).__name__}: {exc}")
                rows.append({**base, "variant": shown, "error": f"{type(exc).__name__}: {exc}"})
                continue
            row["variant"] = shown
            if reference is None and label == "default":
                reference = index
            else:
                del index
            rows.append({**base, **row})
            log(
                f"L={seqlen}: {shown}: score {row['score_ms']:.3f} ms, index {row['index_ms']:.3f} ms, identical "
                f"{row.get('identical_to_default', '-')} ({row.get('pairs_differing_from_default', '-')} pairs differ)"
            )
        write_json(out, index_speed.sanitize(payload))
        w = reference = None  # free the workload before the next L
    text = table(rows)
    print(text)
    for seqlen in args.seqlens:
        timed = [r for r in rows if r["L"] == seqlen and "score_ms" in r]
        if timed:
            best = min(timed, key=lambda r: r["score_ms"])
            fastest = min(timed, key=lambda r: r["index_ms"])
            graph = fmt(fastest.get("index_graph_ms"), ".3f")
            print(
                f"L={seqlen}: fastest scoring kernel {best['variant']} ({best['score_ms']:.3f} ms), fastest index call "
                f"{fastest['variant']} ({fastest['index_ms']:.3f} ms, GPU only {graph} ms)"
            )
    for r in rows:
        if r.get("profile"):
            top = ", ".join(f"{p['kernel'][:40]} {p['us']:.0f} us" for p in r["profile"][:3])
            print(f"L={r['L']} {r['variant']}: {top}")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
