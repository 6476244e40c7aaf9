"""GPU time of the tile repack (``fpv2.kernel.triton.tile_repack``) on the planted workload's cache.

Times ``repack_to_tile_pages`` with CUDA events (median of ``--repeats`` after warm-up) for each length,
and reports the bytes it moves (one read and one write of K and V) as an effective bandwidth. With
``--sweep`` each shape is timed at every (tokens per program, warps) pair of ``SWEEP``. Writes a JSON
list of rows to ``--out``.

Usage (the packages' ``src`` on ``PYTHONPATH``, on a GPU):
``python benchmarks/tile_repack_speed.py --lengths 32768 131072 --batch 1 4 --out repack.json``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fpv2.kernel.testing import planted_workload
from fpv2.kernel.triton.tile_repack import NUM_WARPS, TOKENS_PER_PROGRAM, repack_to_tile_pages, tile_repack_bytes
from fpv2.serving.timing import median, timed_samples

#: (tokens per program, warps) pairs of ``--sweep``.
SWEEP = [(16, 4), (16, 8), (32, 4), (32, 8), (64, 8), (8, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="time every (tokens, warps) pair of SWEEP")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for batch_size in args.batch:
        for length in args.lengths:
            wl = planted_workload(
                [length] * batch_size,
                num_q_heads=args.kv_heads,
                num_kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                page_size=args.page_size,
                device=device,
            )
            _ = wl.batch.host  # the grid's host view, read once as a pipeline call finds it cached
            for tokens, warps in SWEEP if args.sweep else [(TOKENS_PER_PROGRAM, NUM_WARPS)]:

                def call(wl=wl, tokens=tokens, warps=warps) -> object:
                    return repack_to_tile_pages(
                        wl.k_cache, wl.v_cache, wl.batch, tokens_per_program=tokens, num_warps=warps
                    )

                samples, _ = timed_samples(call, 3, args.repeats, device)
                ms = median(samples)
                moved = 2 * tile_repack_bytes(wl.k_cache, wl.batch)  # read and write
                row = {
                    "B": batch_size,
                    "L": length,
                    "page_size": args.page_size,
                    "Hkv": args.kv_heads,
                    "d": args.head_dim,
                    "tokens_per_program": tokens,
                    "num_warps": warps,
                    "ms": round(ms, 4),
                    "copy_bytes": moved // 2,
                    "GB_per_s": round(moved / ms / 1e6, 1),
                    "gpu": torch.cuda.get_device_name(device),
                }
                rows.append(row)
                print(json.dumps(row))
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
