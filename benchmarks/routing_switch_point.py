"""Measure where the sparse pipeline starts to beat dense attention, and write the routing table.

On the planted workload (BENCHMARKS.md), B=1 and no prefix, at each KV length
of ``--seqlens`` and for every (page size, alpha) asked for, this times
(median of ``--repeats`` runs after ``--warmup``, CUDA events on a GPU; on a GPU
also with the host ahead of the GPU, as inside a model's forward pass, where
the host issues a layer's attention while the GPU still runs earlier work;
``--timing`` picks which pair the curve compares, host-ahead by default, and
the results JSON keeps both):

- ``sparse``: the whole :class:`fpv2.serving.pipeline.SparsePrefillPipeline` call
  (pooling, index, correction plan, attention) with ``min_sparse_kv_len = 0``, so
  the curve shows what selection costs and saves at every length;
- ``dense``: the dense path :class:`fpv2.serving.routing.RoutedPrefillPipeline`
  would take for a short request (the kernel's dense mode when the backend has
  one, else the ``dense`` strategy without correction).

It writes the routing table (``--table``, default ``<out>/routing-table.json``,
schema ``fpv2-routing/1``, read by :class:`fpv2.serving.routing.RoutingTable`),
a results JSON with every sample, a PNG (ms against L for both paths per key,
the switch point marked) and prints the switch point of every key.

Defaults are the device shapes (Hq=32, Hkv=8, d=128, bf16, page size 1,
L in 2K..32K, CUDA). ``--device cpu`` with tiny sizes is a dry run of the
plumbing; CPU times are not routing data.

Example::

    python benchmarks/routing_switch_point.py --out benchmarks/results/routing
    python benchmarks/routing_switch_point.py --device cpu --seqlens 256 512 1024 2048 --q-heads 4 --kv-heads 2 \\
        --head-dim 64 --dtype fp32 --backend reference --sink-tokens 128 --window-tokens 128 \\
        --repeats 3 --warmup 1 --out routing-dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.environment import environment_record, git_commit, gpu_name
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.pipeline import PrefillResult
from fpv2.serving.report import write_json
from fpv2.serving.routing import (
    DTYPE_NAMES,
    RoutedPrefillPipeline,
    RoutingCurve,
    RoutingKey,
    RoutingPoint,
    RoutingTable,
)
from fpv2.serving.timing import benchmark_device, host_ahead_samples, median, protocol_notes, timed_samples

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items() if name != "fp8"}
#: Fewest timed runs the protocol accepts on a GPU.
#: The KV lengths of the issue (2K .. 32K).
DEFAULT_SEQLENS = (2048, 4096, 8192, 16384, 32768)
#: What a curve's points compare (``--timing``).
TIMINGS = ("host-ahead", "eager")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options.

    Args:
        argv: arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS), help="KV lengths (2K..32K)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1], help="one curve per page size (default 1)")
    p.add_argument("--alphas", type=float, nargs="+", default=[SelectionConfig.alpha], help="one curve per alpha")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--sink-tokens", type=int, default=None, help="default: SelectionConfig's")
    p.add_argument("--window-tokens", type=int, default=None, help="default: SelectionConfig's")
    p.add_argument("--no-correction", action="store_true", help="time the sparse pipeline without the correction")
    p.add_argument("--strategy", default="max_threshold")
    p.add_argument("--backend", default="auto", help="attention backend (auto, triton, reference, hopper)")
    p.add_argument("--dense-mode", choices=("auto", "kernel", "strategy"), default="auto")
    p.add_argument("--fraction", type=float, default=0.02, help="planted fraction of key blocks")
    p.add_argument("--margin", type=float, default=7.0, help="planted logit margin")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--timing",
        choices=TIMINGS,
        default="host-ahead",
        help="the times the curve compares: host-ahead (default; GPU time with the host ahead, as inside a model's "
        "forward pass) or eager (CUDA events around each call, the host's time to issue it included); the CPU "
        "always times eagerly; both are recorded per point",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True, help="folder for the table, results JSON and plot")
    p.add_argument("--table", type=Path, default=None, help="routing table file (default <out>/routing-table.json)")
    p.add_argument("--merge", action="store_true", help="keep curves of other keys already in --table")
    args = p.parse_args(argv)
    for name in ("q_heads", "kv_heads", "head_dim", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or any(n < 1 for n in args.seqlens) or any(s < 1 for s in args.page_sizes):
        p.error("--warmup must be >= 0, every --seqlens and --page-sizes value >= 1")
    if len(set(args.seqlens)) != len(args.seqlens):
        p.error("--seqlens must be distinct")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.table is None:
        args.table = args.out / "routing-table.json"
    return args


def measure_point(
    args: argparse.Namespace,
    device: torch.device,
    routed: RoutedPrefillPipeline,
    key: RoutingKey,
    kv_len: int,
    log: Callable[[str], None],
) -> tuple[RoutingPoint, dict[str, object]]:
    """Time the sparse pipeline and the dense path of ``routed`` at one KV length.

    Args:
        args: options.
        device: where to run.
        routed: the routed pipeline whose two paths are timed.
        key: the curve's key (page size, dtype and head shapes of the workload).
        kv_len: the KV length (one request, no prefix).
        log: progress printer.

    Returns:
        ``(point, result row)``.
    """
    log(f"[{key}] L={kv_len}: building the planted workload")
    wl = planted_workload(
        [kv_len],
        num_q_heads=key.q_heads,
        num_kv_heads=key.kv_heads,
        head_dim=key.head_dim,
        page_size=key.page_size,
        fraction=args.fraction,
        margin=args.margin,
        dtype=DTYPES[key.dtype],
        device=device,
        seed=args.seed,
    )
    q, k, v, batch = wl.q, wl.k_cache, wl.v_cache, wl.batch
    _ = batch.host  # read the host view once: an engine seeds it and never pays that sync per call
    log(f"[{key}] L={kv_len}: timing the sparse pipeline")
    sparse = routed.sparse_pipeline

    def sparse_call() -> object:
        return sparse(q, k, v, batch)

    sparse_samples, result = timed_samples(sparse_call, args.warmup, args.repeats, device)
    assert isinstance(result, PrefillResult)
    density = float(result.index.density(batch))
    stages = result.timings
    sparse_out = result.out
    del result
    sparse_ahead = _host_ahead(sparse_call, args, device)
    log(f"[{key}] L={kv_len}: timing the dense path ({routed.dense_path})")

    def dense_call() -> object:
        return routed.run_dense(q, k, v, batch)

    dense_samples, dense_out = timed_samples(dense_call, args.warmup, args.repeats, device)
    assert isinstance(dense_out, torch.Tensor)
    dense_ahead = _host_ahead(dense_call, args, device)
    # The two paths must agree up to the selection's error, or the timing compares different things.
    error = relative_l2_error(sparse_out, dense_out)
    eager = (median(sparse_samples), median(dense_samples))
    ahead = (median(sparse_ahead), median(dense_ahead)) if sparse_ahead and dense_ahead else None
    # A call that never let the host get ahead has no host-ahead time: its point falls back to the eager pair.
    timing = "host-ahead" if args.timing == "host-ahead" and ahead is not None else "eager"
    sparse_ms, dense_ms = ahead if timing == "host-ahead" else eager
    point = RoutingPoint(kv_len, sparse_ms, dense_ms, density)
    row = {
        **key.to_dict(),
        "kv_len": kv_len,
        "timing": timing,
        "sparse_ms": point.sparse_ms,
        "dense_ms": point.dense_ms,
        "speedup": point.dense_ms / point.sparse_ms,
        "eager_sparse_ms": eager[0],
        "eager_dense_ms": eager[1],
        "host_ahead_sparse_ms": ahead[0] if ahead else None,
        "host_ahead_dense_ms": ahead[1] if ahead else None,
        "density": density,
        "sparse_vs_dense_rel_err": error,
        "last_sparse_stages_ms": dataclasses.asdict(stages),
        "sparse_samples_ms": sparse_samples,
        "dense_samples_ms": dense_samples,
        "host_ahead_sparse_samples_ms": sparse_ahead,
        "host_ahead_dense_samples_ms": dense_ahead,
    }
    return point, row


def _curve_timing(point_timings: list[str]) -> str:
    """The curve's ``timing``: the one its points share, or ``"mixed"``."""
    kinds = set(point_timings)
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _host_ahead(call: Callable[[], object], args: argparse.Namespace, device: torch.device) -> list[float] | None:
    """Host-ahead samples of ``call`` (CUDA only, right after its eager samples warmed it up), else None."""
    if device.type != "cuda":
        return None
    samples, _ = host_ahead_samples(call, args.repeats, device)
    return samples


def measure_curve(
    args: argparse.Namespace, device: torch.device, page_size: int, alpha: float, log: Callable[[str], None]
) -> tuple[RoutingCurve, list[dict[str, object]]]:
    """Time both paths at every length for one (page size, alpha).

    Args:
        args: options.
        device: where to run.
        page_size: KV cache page size.
        alpha: selection alpha.
        log: progress printer.

    Returns:
        ``(curve, result rows)``.
    """
    overrides: dict[str, object] = {"alpha": alpha, "min_sparse_kv_len": 0}
    if args.sink_tokens is not None:
        overrides["sink_tokens"] = args.sink_tokens
    if args.window_tokens is not None:
        overrides["window_tokens"] = args.window_tokens
    config = SelectionConfig(**overrides)
    routed = RoutedPrefillPipeline(
        config,
        strategy=args.strategy,
        correction=not args.no_correction,
        backend=args.backend,
        dense_mode=args.dense_mode,
    )
    key = RoutingKey(args.q_heads, args.kv_heads, args.head_dim, args.dtype, page_size, alpha)
    points, rows = [], []
    for kv_len in sorted(args.seqlens):
        point, row = measure_point(args, device, routed, key, kv_len, log)
        points.append(point)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta = {
        "gpu": gpu_name(device),
        "backend": routed.backend.name,
        "dense_path": routed.dense_path,
        "strategy": args.strategy,
        "correction": not args.no_correction,
        "selection": {f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
        "workload": "planted",
        "batch": 1,
        "timer": "cuda-events" if device.type == "cuda" else "perf_counter",
        # What the points compare (each point's sparse and dense times are of one kind; see the result rows).
        "timing": _curve_timing([str(r["timing"]) for r in rows]),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "commit": git_commit(),
    }
    return RoutingCurve(key, tuple(points), meta), rows


def write_plot(path: Path, curves: list[RoutingCurve]) -> Path:
    """PNG of ms against KV length (log-log), sparse and dense per key, switch points marked.

    Args:
        path: output file.
        curves: the measured curves.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 5.0), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"]
    for i, curve in enumerate(curves):
        color = colors[i % len(colors)]
        lens = [p.kv_len for p in curve.points]
        label = f"p{curve.key.page_size} a{curve.key.alpha:g}"
        ax.plot(lens, [p.sparse_ms for p in curve.points], "o-", color=color, label=f"sparse pipeline ({label})")
        ax.plot(lens, [p.dense_ms for p in curve.points], "s--", color=color, label=f"dense path ({label})")
        switch = curve.switch_kv_len()
        if switch is not None:
            ax.axvline(switch, color=color, linestyle=":", linewidth=1.2)
            # x in data units, y in axes units: the label stays inside whatever the y range becomes.
            ax.text(
                switch,
                0.03,
                f" switch {switch:,.0f}",
                transform=ax.get_xaxis_transform(),
                rotation=90,
                va="bottom",
                color=color,
                fontsize=8,
            )
    key = curves[0].key
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("KV length L (tokens, B=1, no prefix)")
    ax.set_ylabel("median ms")
    ax.set_title(
        f"sparse pipeline vs dense path, Hq={key.q_heads} Hkv={key.kv_heads} d={key.head_dim} {key.dtype}\n"
        f"{curves[0].meta.get('gpu', '?')}, backend {curves[0].meta.get('backend', '?')}, "
        f"dense path: {curves[0].meta.get('dense_path', '?')}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def markdown_table(curves: list[RoutingCurve]) -> str:
    """The measurements as a markdown table.

    Args:
        curves: the curves.

    Returns:
        The table text.
    """
    lines = [
        "| page | alpha | L | sparse ms | dense ms | dense / sparse | density | route |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in curves:
        for p in c.points:
            route = "sparse" if c.prefers_sparse(p.kv_len) else "dense"
            density = "-" if p.density is None else f"{p.density:.3f}"
            lines.append(
                f"| {c.key.page_size} | {c.key.alpha:g} | {p.kv_len} | {p.sparse_ms:.3f} | {p.dense_ms:.3f} "
                f"| {p.dense_ms / p.sparse_ms:.2f} | {density} | {route} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``).

    Returns:
        The process exit status.
    """
    args = parse_args(argv)
    try:
        device = benchmark_device(args.device)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    notes = protocol_notes(device, args.repeats, "perf_counter times check the plumbing; they are not routing data")
    notes.append(
        "sparse_ms: whole pipeline call (pooling, index, correction plan, attention) with min_sparse_kv_len=0; "
        "dense_ms: the dense path of RoutedPrefillPipeline; both medians, the host view read beforehand"
    )
    for note in notes:
        log(f"note: {note}")

    curves, rows = [], []
    for page_size in args.page_sizes:
        for alpha in args.alphas:
            curve, curve_rows = measure_curve(args, device, page_size, alpha, log)
            curves.append(curve)
            rows += curve_rows

    kept: list[RoutingCurve] = []
    if args.merge and args.table.exists():
        old = RoutingTable.load(args.table)
        new_keys = {c.key for c in curves}
        kept = [old.curve(k) for k in old.keys if k not in new_keys]  # type: ignore[misc]
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    table = RoutingTable([*kept, *curves], meta={"created": created, "gpu": gpu_name(device), "notes": notes})
    table_path = table.save(args.table)
    tag = f"{args.dtype}-Hq{args.q_heads}-Hkv{args.kv_heads}-d{args.head_dim}"
    results_path = write_json(
        args.out / f"routing-switch-point-{tag}.json",
        {
            "benchmark": "routing_switch_point",
            "created": created,
            "commit": git_commit(),
            "gpu": gpu_name(device),
            "environment": environment_record(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "notes": notes,
            "switch_kv_len": {str(c.key): c.switch_kv_len() for c in curves},
            "rows": rows,
        },
    )
    plot_path = write_plot(args.out / f"routing-switch-point-{tag}.png", curves)
    text = markdown_table(curves)
    (args.out / f"routing-switch-point-{tag}.md").write_text(text + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    print(text)
    for c in curves:
        switch = c.switch_kv_len()
        if switch is not None:
            print(f"switch point [{c.key}]: sparse from L = {switch:,.0f} tokens on")
        elif c.prefers_sparse(c.points[-1].kv_len):
            print(f"switch point [{c.key}]: none, sparse wins over the whole measured range")
        else:
            print(f"switch point [{c.key}]: none, dense wins at the longest measured length")
    log(f"wrote {table_path}, {results_path}, {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
