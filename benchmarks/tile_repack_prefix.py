"""Where the tile repack stops paying: a chunk of queries after a cached prefix, copy forced on and off.

For each ``--chunks`` size, a planted request with that many queries at the end of ``--seqlen`` keys (page
size 1) runs through the corrected pipeline on the Hopper backend with ``FPV2_HOPPER_REPACK=1`` and ``=0``,
alternating (on, off, off, on); prints and writes the median eager milliseconds of each, so the query share
from which the copy pays can be read off (``fpv2.serving.tile_repack_policy.MIN_QUERY_SHARE``).

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``python benchmarks/tile_repack_prefix.py --seqlen 131072 --chunks 4096 16384 32768 65536 --out prefix.json``
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from fpv2.kernel.testing import planted_workload
from fpv2.serving import SparsePrefillPipeline
from fpv2.serving.tile_repack_policy import REPACK_ENV
from fpv2.serving.timing import median, timed_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072, help="KV length, the prefix included")
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for chunk in args.chunks:
        wl = planted_workload(
            [chunk], [args.seqlen], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device
        )
        pipeline = SparsePrefillPipeline(backend="hopper")
        runs: dict[str, list[float]] = {"1": [], "0": []}

        def call(pipeline=pipeline, wl=wl) -> object:
            return pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch)

        for mode in ("1", "0", "0", "1"):
            os.environ[REPACK_ENV] = mode
            samples, _ = timed_samples(call, 2, args.repeats, device)
            runs[mode].append(median(samples))
        row = {
            "q_len": chunk,
            "kv_len": args.seqlen,
            "query_share": chunk / args.seqlen,
            "repack_ms": runs["1"],
            "gather_ms": runs["0"],
            "repack_pays": median(runs["1"]) < median(runs["0"]),
            "gpu": torch.cuda.get_device_name(device),
        }
        rows.append(row)
        print(json.dumps(row))
    os.environ.pop(REPACK_ENV, None)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
