"""Per-chunk attention of the chunked pipelines: where the chunk-aware pipeline's attention time goes.

Runs :class:`fpv2.serving.chunked.ChunkedPrefillPipeline` on the planted workload in
chunks of ``--chunk`` queries three ways: per chunk (``naive``: each chunk selected as a
whole prefill, a dense tail in every chunk), chunk-aware (``aware``: the whole
prompt's selection, on the tile pages it carries across chunks at small page
sizes) and chunk-aware without the carried pages (``aware-per-call``: the
backend's own copy of each call's whole KV, as before 2026-12-06), records every chunk's attention call (the backend's
``run`` with its index and correction plan), then replays each recorded call
``--calls`` times back to back between two CUDA events, ``--rounds`` rounds with
the two pipelines interleaved. For each chunk it prints the kept and visible
(tile, block) pairs, the pipeline's own index- and attention-stage times (CUDA events in an
eager run: host gaps included) and the replayed launch's time (the kernels
alone). Sums over the chunks tell whether a difference between the pipelines is
in the kernels or around them.

Example (on the device, from the repository root, with the packages on PYTHONPATH)::

    python benchmarks/chunk_attention_probe.py --seqlen 131072 --chunk 8192 --out probe.jsonl

``--device cpu`` with a small ``--seqlen`` and ``--backend reference`` is a dry run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from attention_switch_probe import recorded_backend_calls, timed  # this folder, first on sys.path as a script

from fpv2.index import SelectionConfig
from fpv2.kernel.contracts import num_query_tiles
from fpv2.kernel.testing import planted_workload
from fpv2.serving import chunked
from fpv2.serving.backends import resolve_backend
from fpv2.serving.chunked import ChunkedPrefillPipeline, ChunkedPrefillResult

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("naive", "aware", "aware-per-call")


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072, help="prompt length (one request)")
    parser.add_argument("--chunk", type=int, default=8192, help="queries per chunk")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--backend", default="hopper", help="serving backend name (hopper, triton, reference)")
    parser.add_argument("--rounds", type=int, default=5, help="replay rounds, the pipelines interleaved")
    parser.add_argument("--calls", type=int, default=3, help="launches per replay, back to back")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="append one JSON line per pipeline here")
    return parser.parse_args()


def recorded_chunks(pipe: ChunkedPrefillPipeline, workload, chunk: int) -> tuple[ChunkedPrefillResult, list]:
    """Runs ``pipe`` once; returns its result and each chunk's attention call as (run, args, kwargs)."""
    return recorded_backend_calls(
        pipe.backend,
        lambda: pipe.run(workload.q, workload.k_cache, workload.v_cache, workload.batch, chunk_size=chunk),
    )


def replay_ms(call: tuple[Callable, tuple, dict], calls: int, device: torch.device) -> float:
    """Milliseconds per launch of ``calls`` replays of one recorded attention call (wall time off CUDA)."""
    run, args, kwargs = call
    if device.type == "cuda":
        return timed(lambda: run(*args, **kwargs), calls)
    begin = time.perf_counter()
    for _ in range(calls):
        run(*args, **kwargs)
    return (time.perf_counter() - begin) * 1e3 / calls


def chunk_rows(result: ChunkedPrefillResult, group: int) -> list[dict[str, object]]:
    """Per chunk: its queries, KV length, tiles per KV head, kept / visible pairs, pipeline attention ms."""
    rows = []
    for chunk in result.chunks:
        host = chunk.batch.host
        segments = chunk.index.num_segments
        per_tile = chunk.index.offsets[: segments + 1].diff().float()  # kept blocks of each (tile, KV head)
        rows.append(
            {
                "q_len": sum(host.q_lens),
                "kv_len": max(host.seqlens_k),
                "tiles": sum(num_query_tiles(n, group) for n in host.q_lens),
                "kept_pairs": chunk.kept_pairs,
                "visible_pairs": chunk.visible_pairs,
                "dense_tiles": chunk.dense_tiles,
                "kept_max": int(per_tile.max()),
                "kept_mean": float(per_tile.mean()),
                "stage_index_ms": chunk.timings.index_ms,
                "stage_attention_ms": chunk.timings.attention_ms,
            }
        )
    return rows


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    group = args.q_heads // args.kv_heads
    workload = planted_workload(
        [args.seqlen],
        num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        dtype=DTYPES[args.dtype],
        device=device,
        seed=0,
    )
    config = SelectionConfig(alpha=args.alpha)
    runs = {}
    carried = chunked.carried_tile_copies
    for mode in MODES:
        pipe = ChunkedPrefillPipeline(
            config, correction=True, backend=resolve_backend(args.backend), chunk_aware=mode != "naive"
        )
        chunked.carried_tile_copies = (lambda *_: None) if mode == "aware-per-call" else carried
        recorded_chunks(pipe, workload, args.chunk)  # warm-up: compiles, allocator, clocks
        result, calls = recorded_chunks(pipe, workload, args.chunk)
        runs[mode] = (chunk_rows(result, group), calls)
    chunked.carried_tile_copies = carried
    replays: dict[str, list[list[float]]] = {mode: [[] for _ in runs[mode][1]] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            for samples, call in zip(replays[mode], runs[mode][1]):
                samples.append(replay_ms(call, args.calls, device))
    header = f"{'chunk':>5} {'kv_len':>7} {'tiles':>6}"
    for mode in MODES:
        header += f" | {mode:>14} {'kept':>6} {'density':>7} {'index':>6} {'attn':>6} {'replay':>6}"
    header += " | aware kept max/mean"
    print(header)
    for i, naive_row in enumerate(runs["naive"][0]):
        line = f"{i:>5} {naive_row['kv_len']:>7} {naive_row['tiles']:>6}"
        for mode in MODES:
            row = runs[mode][0][i]
            row["replay_ms"] = statistics.median(replays[mode][i])
            density = row["kept_pairs"] / max(row["visible_pairs"], 1)
            line += (
                f" | {'':>14} {row['kept_pairs']:>6} {density:>7.4f} {row['stage_index_ms']:>6.3f}"
                f" {row['stage_attention_ms']:>6.3f} {row['replay_ms']:>6.3f}"
            )
        aware = runs["aware"][0][i]
        print(f"{line} | {aware['kept_max']:>6} / {aware['kept_mean']:.1f}")
    for mode in MODES:
        rows = runs[mode][0]
        kept = sum(r["kept_pairs"] for r in rows)
        visible = sum(r["visible_pairs"] for r in rows)
        index = sum(r["stage_index_ms"] for r in rows)
        stage = sum(r["stage_attention_ms"] for r in rows)
        replay = sum(r["replay_ms"] for r in rows)
        print(
            f"{mode}: density {kept / visible:.4f}, stage index {index:.3f} ms, stage attention {stage:.3f} ms, "
            f"replayed {replay:.3f} ms"
        )
        if args.out:
            with open(args.out, "a") as fh:
                record = {"mode": mode, "seqlen": args.seqlen, "chunk": args.chunk, "backend": args.backend}
                record.update({"density": kept / visible, "index_ms": index, "stage_ms": stage, "replay_ms": replay})
                record["chunks"] = rows
                fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
