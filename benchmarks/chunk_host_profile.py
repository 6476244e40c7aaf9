"""Where the chunked pipeline's host time goes: cProfile of whole chunked prefills on the GPU.

Runs ``ChunkedPrefillPipeline.run`` (chunk-aware by default, or ``--naive``) over a planted prompt in chunks, warms
it up, then profiles ``--calls`` whole prefills, each followed by a device synchronisation, and prints the wall time
per prefill with and without the profiler and the functions with the most cumulative and own time. The profiler
slows Python about twofold; the ranking is what it is for.

Usage (the packages' ``src`` on ``PYTHONPATH``, on a GPU):
``python benchmarks/chunk_host_profile.py --seqlen 131072 --chunk 8192 --backend hopper``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.chunked import ChunkedPrefillPipeline


def wall_ms(run, calls: int) -> float:
    """Median wall milliseconds of ``calls`` synchronised calls."""
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--backend", default="hopper")
    parser.add_argument("--naive", action="store_true", help="the per-chunk pipeline instead of the chunk-aware one")
    parser.add_argument(
        "--uncarried", action="store_true", help="chunk-aware without carried tile pages (as the engine adapters run)"
    )
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    wl = planted_workload(
        [args.seqlen], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=args.page_size,
        device=torch.device("cuda"), seed=0,
    )  # fmt: skip
    pipe = ChunkedPrefillPipeline(
        SelectionConfig(), backend=args.backend, chunk_aware=not args.naive, carry_tile_pages=not args.uncarried
    )

    def run() -> object:
        return pipe.run(wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=args.chunk)

    plain_ms = wall_ms(run, 3 + args.calls)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled_ms = wall_ms(run, args.calls)
    profiler.disable()
    chunks = -(-args.seqlen // args.chunk)
    backend = pipe.backend.name
    print(f"prefill wall ms: {plain_ms:.2f} plain, {profiled_ms:.2f} profiled; {chunks} chunks; backend {backend}")
    for key in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
        print(f"\n==== by {key} ({args.calls} prefills) ====")
        print(text.getvalue())


if __name__ == "__main__":
    main()
