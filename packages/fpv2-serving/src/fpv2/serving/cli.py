"""The ``fpv2`` command line: ``fpv2 info`` and ``fpv2 bench``.

Exit codes: 0 success, 1 a runtime failure (e.g. a named backend is not
available), 2 bad arguments (with a message on stderr).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

#: Small input used when no GPU is there and no sizes are given (runs in seconds on 2 cores).
CPU_DEFAULTS = {
    "batch": 1,
    "seqlen": 4096,
    "q_heads": 8,
    "kv_heads": 2,
    "head_dim": 64,
    "page_size": 1,
    "dtype": "fp32",
    "min_sparse_kv_len": 0,
    "repeats": 3,
    "warmup": 1,
}
#: The protocol's standard shape (BENCHMARKS.md) for GPU runs.
GPU_DEFAULTS = {
    "batch": 1,
    "seqlen": 8192,
    "q_heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "page_size": 1,
    "dtype": "bf16",
    "min_sparse_kv_len": None,
    "repeats": 10,
    "warmup": 3,
}
_SIZE_KEYS = ("batch", "seqlen", "q_heads", "kv_heads", "head_dim")
DEFAULT_ALPHA = 0.1


class _ArgumentError(Exception):
    """A semantic argument problem found after parsing (reported with exit code 2)."""


def _build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``fpv2`` parser and its ``bench`` sub-parser (for usage lines of semantic errors)."""
    parser = argparse.ArgumentParser(prog="fpv2", description="fpv2 block-sparse prefill attention tools")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench}")
    sub.required = True
    sub.add_parser("info", help="versions, native library, GPU, backends and strategies")

    bench = sub.add_parser(
        "bench",
        help="time and check the sparse pipeline on a planted workload",
        description=(
            "Time the sparse prefill pipeline against the backend's dense mode (and torch SDPA on CUDA) on a "
            "planted workload; write a results JSON, summary.json and a selection heatmap. Without a GPU and "
            "without explicit sizes it runs a small CPU input."
        ),
    )
    size = bench.add_argument_group("shape (defaults: the standard shape on a GPU, a small input on the CPU)")
    size.add_argument("-B", "--batch", type=int, help="requests (all of length L)")
    size.add_argument("-L", "--seqlen", type=int, help="tokens per request (query = KV, no prefix)")
    size.add_argument("--q-heads", type=int, help="query heads Hq")
    size.add_argument("--kv-heads", type=int, help="KV heads Hkv (divides Hq)")
    size.add_argument("--head-dim", type=int, help="head dimension d (64, 128 or 256)")
    size.add_argument("--page-size", type=int, help="KV cache page size (default 1)")
    size.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "fp8"), help="input element type")
    size.add_argument(
        "--cache-layout",
        choices=("paged", "vllm"),
        default="paged",
        help="K/V as one paged cache each (default), or as vLLM's strided views of one buffer per layer",
    )
    wl = bench.add_argument_group("workload")
    wl.add_argument("--fraction", type=float, default=0.02, help="share of planted key blocks per KV head")
    wl.add_argument("--margin", type=float, default=7.0, help="logit margin of the planted blocks")
    wl.add_argument("--needle", action="store_true", help="plant a needle block and report its rows' error")
    wl.add_argument(
        "--drift-tokens",
        type=float,
        help="plant on the drifting background (AR(1) keys, values and queries with this correlation length in "
        "tokens, a per-head mean, RoPE) instead of N(0, 1): a harder accuracy test; workload 'drifting'",
    )
    wl.add_argument("--seed", type=int, default=0, help="workload seed")
    sel = bench.add_argument_group("pipeline")
    sel.add_argument(
        "--alpha", type=float, action="append", help=f"energy threshold in (0, 1]; repeatable (default {DEFAULT_ALPHA})"
    )
    sel.add_argument("--no-correction", action="store_true", help="turn the mean correction off")
    sel.add_argument("--ablation", action="store_true", help="run each alpha with and without the correction")
    sel.add_argument(
        "--mass-shift",
        action="append",
        metavar="{mean,second_order}",
        help="logit shift of the correction's pooled terms: mean (log |B_J|, the default) or second_order (also "
        "the blocks' key spread; runs on the Triton kernel under auto); repeatable: each corrected run per shift",
    )
    sel.add_argument("--strategy", default="max_threshold", help="selection strategy (see fpv2 info)")
    sel.add_argument("--backend", default="auto", help="attention backend: auto or a name (see fpv2 info)")
    sel.add_argument("--min-sparse-kv-len", type=int, help="requests shorter than this stay dense")
    run = bench.add_argument_group("measurement")
    run.add_argument("--repeats", type=int, help="timed runs (default 10 on a GPU, 3 on the CPU)")
    run.add_argument("--warmup", type=int, help="warm-up runs (default 3 on a GPU, 1 on the CPU)")
    run.add_argument(
        "--warmup-ms",
        type=float,
        default=0.0,
        help="GPU: first run each timed implementation on its own calls for this many milliseconds, so that it is "
        "timed at its own steady clock rather than the previous row's (default 0: the warm-up runs alone)",
    )
    run.add_argument(
        "--sparse-only",
        action="store_true",
        help="time the sparse runs alone: no own dense mode and no torch SDPA (no speedup columns); for series of "
        "long-context record rows",
    )
    run.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    run.add_argument("--out", type=Path, default=Path("fpv2-results"), help="output folder (default fpv2-results/)")
    run.add_argument("--heatmap-head", type=int, default=0, help="KV head drawn in the heatmap (request 0)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser, bench


def _cmd_info() -> int:
    from .environment import info_lines

    for line in info_lines():
        print(line)
    return 0


def _bench_config(args: argparse.Namespace) -> tuple[object, list[str]]:
    """Fill device-dependent defaults and check the bench arguments.

    Returns:
        ``(BenchConfig, notices to print)``.

    Raises:
        _ArgumentError: an argument is out of range or inconsistent.
    """
    import torch

    from fpv2.index import available_strategies
    from fpv2.kernel.contracts import SUPPORTED_HEAD_DIMS

    from .backends import AUTO, registered_backends
    from .bench import BenchConfig
    from .pipeline import MASS_SHIFTS

    if args.device is None:
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_name = args.device
    try:
        device = torch.device(device_name)
    except (RuntimeError, ValueError) as exc:
        raise _ArgumentError(f"--device {device_name!r} is not a torch device ({exc})") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _ArgumentError(f"--device {device_name} asks for CUDA, but no CUDA device is available")
    if device.type not in ("cuda", "cpu"):
        raise _ArgumentError(f"--device must be a cpu or cuda device; got {device_name!r}")
    on_gpu = device.type == "cuda"
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    notices = []
    if not on_gpu and all(getattr(args, key) is None for key in _SIZE_KEYS):
        d = CPU_DEFAULTS
        notices.append(
            f"no GPU: running the reference path on a small CPU input (B={d['batch']}, L={d['seqlen']}, "
            f"Hq={d['q_heads']}, Hkv={d['kv_heads']}, d={d['head_dim']}, {args.dtype or d['dtype']}, "
            f"min_sparse_kv_len={d['min_sparse_kv_len'] if args.min_sparse_kv_len is None else args.min_sparse_kv_len})"
        )
    value = {
        key: getattr(args, key) if getattr(args, key) is not None else default for key, default in defaults.items()
    }

    for key, flag in (
        ("batch", "--batch"),
        ("seqlen", "--seqlen"),
        ("q_heads", "--q-heads"),
        ("kv_heads", "--kv-heads"),
        ("page_size", "--page-size"),
        ("repeats", "--repeats"),
    ):
        if value[key] < 1:
            raise _ArgumentError(f"{flag} must be >= 1; got {value[key]}")
    if value["warmup"] < 0:
        raise _ArgumentError(f"--warmup must be >= 0; got {value['warmup']}")
    if not (math.isfinite(args.warmup_ms) and args.warmup_ms >= 0):
        raise _ArgumentError(f"--warmup-ms must be a finite number >= 0; got {args.warmup_ms}")
    if value["min_sparse_kv_len"] is not None and value["min_sparse_kv_len"] < 0:
        raise _ArgumentError(f"--min-sparse-kv-len must be >= 0; got {value['min_sparse_kv_len']}")
    if value["q_heads"] % value["kv_heads"]:
        raise _ArgumentError(
            f"--q-heads {value['q_heads']} must be a multiple of --kv-heads {value['kv_heads']} "
            "(grouped-query attention)"
        )
    if value["head_dim"] not in SUPPORTED_HEAD_DIMS:
        raise _ArgumentError(f"--head-dim must be one of {SUPPORTED_HEAD_DIMS}; got {value['head_dim']}")
    alphas = tuple(dict.fromkeys(args.alpha)) if args.alpha else (DEFAULT_ALPHA,)  # a repeated alpha runs once
    for alpha in alphas:
        if not 0.0 < alpha <= 1.0:
            raise _ArgumentError(f"--alpha must lie in (0, 1]; got {alpha}")
    if not 0.0 < args.fraction <= 1.0:
        raise _ArgumentError(f"--fraction must lie in (0, 1]; got {args.fraction}")
    if args.margin < 0:
        raise _ArgumentError(f"--margin must be >= 0; got {args.margin}")
    if args.drift_tokens is not None and not (math.isfinite(args.drift_tokens) and args.drift_tokens > 0):
        raise _ArgumentError(f"--drift-tokens must be a finite number of tokens > 0; got {args.drift_tokens}")
    if not 0 <= args.heatmap_head < value["kv_heads"]:
        raise _ArgumentError(f"--heatmap-head must lie in 0..{value['kv_heads'] - 1}; got {args.heatmap_head}")
    if args.no_correction and args.ablation:
        raise _ArgumentError("--no-correction and --ablation exclude each other (--ablation runs both)")
    mass_shifts = tuple(dict.fromkeys(args.mass_shift)) if args.mass_shift else ("mean",)
    for shift in mass_shifts:
        if shift not in MASS_SHIFTS:
            raise _ArgumentError(f"--mass-shift {shift!r} is unknown; choose one of: {', '.join(MASS_SHIFTS)}")
    if args.no_correction and args.mass_shift:
        raise _ArgumentError("--mass-shift shifts the correction's terms: drop --no-correction")
    strategies = list(available_strategies())
    if args.strategy not in strategies:
        raise _ArgumentError(f"--strategy {args.strategy!r} is unknown; choose one of: {', '.join(strategies)}")
    if args.backend != AUTO and args.backend not in registered_backends():
        names = ", ".join([AUTO, *registered_backends()])
        raise _ArgumentError(f"--backend {args.backend!r} is unknown; choose one of: {names}")
    config = BenchConfig(
        batch=value["batch"],
        seqlen=value["seqlen"],
        q_heads=value["q_heads"],
        kv_heads=value["kv_heads"],
        head_dim=value["head_dim"],
        page_size=value["page_size"],
        alphas=alphas,
        fraction=args.fraction,
        margin=args.margin,
        dtype=value["dtype"],
        correction=not args.no_correction,
        ablation=args.ablation,
        strategy=args.strategy,
        backend=args.backend,
        min_sparse_kv_len=value["min_sparse_kv_len"],
        repeats=value["repeats"],
        warmup=value["warmup"],
        warmup_ms=args.warmup_ms,
        seed=args.seed,
        device=str(device),
        out=args.out,
        heatmap_head=args.heatmap_head,
        needle=args.needle,
        drift_tokens=args.drift_tokens,
        mass_shifts=mass_shifts,
        progress=not args.no_progress,
        cache_layout=args.cache_layout,
        sparse_only=args.sparse_only,
    )
    return config, notices


def _cmd_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .bench import run_bench

    try:
        config, notices = _bench_config(args)
    except _ArgumentError as exc:
        parser.print_usage(sys.stderr)
        print(f"fpv2 bench: error: {exc}", file=sys.stderr)
        return 2
    for notice in notices:
        print(notice)
    try:
        run_bench(config)  # type: ignore[arg-type]
    except RuntimeError as exc:
        print(f"fpv2 bench: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fpv2`` console script.

    Args:
        argv: arguments without the program name (None: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 success, 1 runtime failure, 2 bad arguments.
    """
    parser, bench_parser = _build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse reports bad arguments (2) and --help (0) this way
        return int(exc.code) if isinstance(exc.code, int) else 2
    if args.command == "info":
        return _cmd_info()
    return _cmd_bench(bench_parser, args)


if __name__ == "__main__":
    sys.exit(main())
