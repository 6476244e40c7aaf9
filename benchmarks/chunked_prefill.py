"""Density and time of chunked prefill: chunk-aware selection vs naive per-chunk selection vs unchunked.

On the planted workload (BENCHMARKS.md), for the whole prompt and for each
``--chunks`` size, this times (median of ``--repeats`` runs after
``--warmup``, CUDA events on a GPU):

- ``dense``: every visible block (the ``dense`` strategy through the chunked
  pipeline, no correction); its attention stage is the dense baseline;
- ``sparse-unchunked``: the plain :class:`fpv2.serving.pipeline.SparsePrefillPipeline`
  on the whole prompt;
- ``sparse-naive``: that pipeline re-run on every chunk as if it were a whole
  prefill (per-chunk dense fallbacks, the prefix re-pooled each time): the
  published implementation's behaviour;
- ``sparse-aware``: :class:`fpv2.serving.chunked.ChunkedPrefillPipeline`
  (whole-prompt fallbacks, pooled statistics carried across chunks);
- ``sparse-aware-uncarried`` (with ``--uncarried``): the same without the
  carried tile pages (``carry_tile_pages=False``), as the engine adapters run
  it (one state per layer cannot afford a copy of each layer's prompt).

With ``--host-ahead`` (CUDA only) each row is also timed with the host ahead of
the GPU (:func:`fpv2.serving.timing.host_ahead_samples`: a spin kernel holds the
stream while the host issues the whole prefill, so the kernels run back to back):
the GPU's own time, which is what a model's forward sees when its other layers
keep the GPU busier than the host (the eager rows of short chunks wait on the
host's work per chunk).

A chunk's KV is the prompt prefix up to the chunk's end, read from a cache
that holds the whole prompt (a chunk never reads past its ``seqlens_k``).
Writes ``chunked-prefill-<tag>.json`` and ``.md`` under ``--out`` and prints
the table. Defaults are the device shapes (L=131072, Hq=32, Hkv=8, d=128,
bf16, CUDA); ``--device cpu`` with a small ``--seqlen`` is a dry run.

Example::

    python benchmarks/chunked_prefill.py --out benchmarks/results/chunked
    python benchmarks/chunked_prefill.py --device cpu --seqlen 8192 --q-heads 8 --kv-heads 2 \\
        --head-dim 64 --chunks 1024 2048 --dtype fp32 --backend reference --repeats 2 --warmup 1 --out chunked-dry-run
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from fpv2.index import SelectionConfig
from fpv2.index.reference.forced import dense_tile_mask
from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.contracts import num_query_tiles
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.testing import planted_workload
from fpv2.serving.backends import resolve_backend
from fpv2.serving.chunked import ChunkedPrefillPipeline, ChunkedPrefillResult
from fpv2.serving.environment import environment_record, git_commit, gpu_name
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.pipeline import PrefillResult, SparsePrefillPipeline
from fpv2.serving.report import write_json
from fpv2.serving.soak import SyncCounter
from fpv2.serving.timing import (
    StageTimings,
    benchmark_device,
    host_ahead_samples,
    median,
    protocol_notes,
    timed_samples,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Fewest timed runs the protocol accepts on a GPU.


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options.

    Args:
        argv: arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seqlen", type=int, default=131072, help="prompt length L (default 131072)")
    p.add_argument("--chunks", type=int, nargs="+", default=[8192, 16384], help="chunk sizes (default 8192 16384)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--alpha", type=float, default=SelectionConfig.alpha)
    p.add_argument("--min-sparse-kv-len", type=int, default=None, help="default: SelectionConfig's")
    p.add_argument("--dense-tail-tiles", type=int, default=None, help="default: SelectionConfig's")
    p.add_argument("--no-correction", action="store_true", help="run the sparse pipelines without the correction")
    p.add_argument("--strategy", default="max_threshold")
    p.add_argument("--backend", default="auto", help="attention backend (auto, triton, reference, hopper)")
    p.add_argument("--fraction", type=float, default=0.02, help="planted fraction of key blocks")
    p.add_argument("--margin", type=float, default=7.0, help="planted logit margin")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-error", action="store_true", help="skip the fp32 dense reference and the error column")
    p.add_argument(
        "--no-chunked-dense",
        action="store_true",
        help="skip the dense rows of the chunked runs (their 'speedup vs dense (same chunking)' column)",
    )
    p.add_argument(
        "--uncarried",
        action="store_true",
        help="add sparse-aware-uncarried rows: chunk-aware without carried tile pages, as the engine adapters run",
    )
    p.add_argument(
        "--host-ahead",
        action="store_true",
        help="also time every row with the host ahead of the GPU (its kernels back to back; CUDA only)",
    )
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and markdown results")
    args = p.parse_args(argv)
    for name in ("seqlen", "q_heads", "kv_heads", "head_dim", "page_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or any(c < 1 for c in args.chunks):
        p.error("--warmup must be >= 0 and every --chunks size >= 1")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def stages_of(result: object) -> StageTimings:
    """Stage times of a pipeline result, summed over chunks for a chunked one."""
    if isinstance(result, ChunkedPrefillResult):
        return result.stage_totals()
    assert isinstance(result, PrefillResult)
    return result.timings


def measure(
    fn: Callable[[], object], args: argparse.Namespace, device: torch.device
) -> tuple[list[float], dict, object]:
    """Warm up, then time ``args.repeats`` calls.

    Args:
        fn: the call.
        args: options (warmup, repeats).
        device: where it runs.

    Returns:
        ``(samples_ms, stage medians, last result)``.
    """
    stages: list[StageTimings] = []

    def collect(result: object, timed: bool) -> None:
        if timed:
            stages.append(stages_of(result))

    samples, result = timed_samples(fn, args.warmup, args.repeats, device, on_call=collect)
    split = {
        "index_ms": median([s.index_ms for s in stages]),
        "correction_ms": median([s.correction_ms for s in stages]),
        "attention_ms": median([s.attention_ms for s in stages]),
        "host_syncs": count_syncs(fn, device),
    }
    if args.host_ahead and device.type == "cuda":
        result = None  # free the output before the host-ahead calls allocate theirs
        ahead, result = host_ahead_samples(fn, args.repeats, device)
        split["host_ahead_samples_ms"] = ahead
        split["host_ahead_ms"] = median(ahead) if ahead else None
    return samples, split, result


def count_syncs(fn: Callable[[], object], device: torch.device) -> int | None:
    """Host synchronisations of one more (warm) call, counted with PyTorch's sync debug mode (CUDA only).

    Args:
        fn: the call.
        device: where it runs.

    Returns:
        The count, or None on the CPU.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with SyncCounter(active=True) as counter:
        counter.reset()
        result = fn()
        count, _ = counter.take()
    del result
    return count


def summarise(result: object, batch: PagedPrefillBatch, config: SelectionConfig) -> dict[str, object]:
    """Density, pooled blocks and dense tiles (per KV head) of a result (host syncs)."""
    if isinstance(result, ChunkedPrefillResult):
        return {
            "density": result.density(),
            "pooled_blocks": result.pooled_blocks,
            "dense_tiles": result.dense_tiles,
            "num_chunks": len(result.chunks),
        }
    assert isinstance(result, PrefillResult)
    group = result.index.group
    dense = sum(
        int(dense_tile_mask(num_query_tiles(n, group, config.tile_size), kv, config, "cpu").sum())
        for n, kv in zip(batch.host.q_lens, batch.host.seqlens_k)
    )
    return {
        "density": result.index.density(batch),
        "pooled_blocks": int(result.statistics.block_offsets[-1]) if result.statistics is not None else 0,
        "dense_tiles": dense,
        "num_chunks": 1,
    }


def fmt(value: object, spec: str) -> str:
    """A table cell (``-`` for missing values)."""
    return "-" if value is None else format(value, spec)


def markdown_table(rows: list[dict[str, object]]) -> str:
    """The results as a markdown table.

    Args:
        rows: result rows.

    Returns:
        The table text.
    """
    head = (
        "| chunk | impl | ms | index ms | corr ms | attn ms | density | pooled blocks | dense tiles | rel err "
        "| speedup vs dense (same chunking) | speedup vs unchunked dense | host syncs | host-ahead ms |"
    )
    lines = [head, "|" + "|".join(["---"] * 14) + "|"]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    "none" if r["chunk"] is None else str(r["chunk"]),
                    str(r["impl"]),
                    fmt(r["ms"], ".2f"),
                    fmt(r["index_ms"], ".2f"),
                    fmt(r["correction_ms"], ".2f"),
                    fmt(r["attention_ms"], ".2f"),
                    fmt(r["density"], ".4f"),
                    fmt(r["pooled_blocks"], "d"),
                    fmt(r["dense_tiles"], "d"),
                    fmt(r["rel_err"], ".4f"),
                    fmt(r["speedup_vs_dense"], ".2f"),
                    fmt(r["speedup_vs_unchunked_dense"], ".2f"),
                    fmt(r.get("host_syncs"), "d"),
                    fmt(r.get("host_ahead_ms"), ".2f"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark.

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
    notes = protocol_notes(device, args.repeats, "perf_counter times check the plumbing, not benchmark numbers")
    notes.append(
        "ms: median wall time of the whole prefill (all chunks, every stage); speedups divide the dense rows' "
        "attention stage (the dense kernel alone) by the sparse rows' whole time"
    )
    backend = resolve_backend(args.backend)
    overrides = {"alpha": args.alpha}
    if args.min_sparse_kv_len is not None:
        overrides["min_sparse_kv_len"] = args.min_sparse_kv_len
    if args.dense_tail_tiles is not None:
        overrides["dense_tail_tiles"] = args.dense_tail_tiles
    config = SelectionConfig(**overrides)
    correction = not args.no_correction

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    for note in notes:
        log(f"note: {note}")
    log(f"building the planted workload L={args.seqlen} Hq={args.q_heads} Hkv={args.kv_heads} d={args.head_dim}")
    wl = planted_workload(
        [args.seqlen],
        num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        fraction=args.fraction,
        margin=args.margin,
        dtype=DTYPES[args.dtype],
        device=device,
        seed=args.seed,
    )
    q, k_cache, v_cache, batch = wl.q, wl.k_cache, wl.v_cache, wl.batch
    ref = None
    if not args.no_error:
        log("computing the fp32 dense reference")
        ref = dense_attention(q.float(), k_cache.float(), v_cache.float(), batch, compute_dtype=torch.float32)

    dense = ChunkedPrefillPipeline(config, strategy="dense", correction=False, backend=backend)
    plain = SparsePrefillPipeline(config, strategy=args.strategy, correction=correction, backend=backend)
    aware = ChunkedPrefillPipeline(config, strategy=args.strategy, correction=correction, backend=backend)
    naive = ChunkedPrefillPipeline(
        config, strategy=args.strategy, correction=correction, backend=backend, chunk_aware=False
    )
    uncarried = ChunkedPrefillPipeline(
        config, strategy=args.strategy, correction=correction, backend=backend, carry_tile_pages=False
    )

    def call(pipe: object, chunk: int | None) -> Callable[[], object]:
        if isinstance(pipe, SparsePrefillPipeline):
            return lambda: pipe(q, k_cache, v_cache, batch)
        size = args.seqlen if chunk is None else chunk
        return lambda: pipe.run(q, k_cache, v_cache, batch, chunk_size=size)

    common = {
        "L": args.seqlen,
        "Hq": args.q_heads,
        "Hkv": args.kv_heads,
        "d": args.head_dim,
        "dtype": args.dtype,
        "page_size": args.page_size,
        "alpha": args.alpha,
        "correction": correction,
        "backend": backend.name,
        "strategy": args.strategy,
        "workload": "planted",
        "timer": "cuda-events" if device.type == "cuda" else "perf_counter",
        "repeats": args.repeats,
        "warmup": args.warmup,
    }
    plan: list[tuple[int | None, str, object]] = [(None, "dense", dense), (None, "sparse-unchunked", plain)]
    for chunk in args.chunks:
        if not args.no_chunked_dense:
            plan.append((chunk, "dense", dense))
        plan += [(chunk, "sparse-naive", naive), (chunk, "sparse-aware", aware)]
        if args.uncarried:
            plan.append((chunk, "sparse-aware-uncarried", uncarried))
    rows: list[dict[str, object]] = []
    for chunk, impl, pipe in plan:
        log(f"timing {impl} at chunk {chunk or 'none'}")
        samples, split, result = measure(call(pipe, chunk), args, device)
        out = result.out
        rows.append(
            {
                **common,
                "chunk": chunk,
                "impl": impl,
                "ms": median(samples),
                "samples_ms": samples,
                **split,
                **summarise(result, batch, config),
                "rel_err": relative_l2_error(out, ref) if ref is not None else None,
            }
        )
        del result, out

    dense_ms = {r["chunk"]: r["attention_ms"] for r in rows if r["impl"] == "dense"}
    for r in rows:
        same = dense_ms.get(r["chunk"])
        r["speedup_vs_dense"] = same / r["ms"] if same and r["impl"] != "dense" else None
        r["speedup_vs_unchunked_dense"] = dense_ms[None] / r["ms"] if r["impl"] != "dense" else None

    table = markdown_table(rows)
    tag = f"{args.dtype}-L{args.seqlen}-Hq{args.q_heads}-Hkv{args.kv_heads}-d{args.head_dim}-p{args.page_size}"
    payload = {
        "benchmark": "chunked_prefill",
        "commit": git_commit(),
        "gpu": gpu_name(device),
        "environment": environment_record(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "selection": {f: getattr(config, f) for f in config.__dataclass_fields__},
        "notes": notes,
        "rows": rows,
    }
    json_path = write_json(args.out / f"chunked-prefill-{tag}.json", payload)
    md_path = args.out / f"chunked-prefill-{tag}.md"
    md_path.write_text(table + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    print(table)
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
