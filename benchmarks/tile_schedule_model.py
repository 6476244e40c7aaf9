"""How long one CTA per tile takes in the decoded order and in the kept-block work order, by a list-schedule model.

Builds the planted workload and its block index (the pipeline's index stage on the GPU), counts each tile's kept
blocks, and replays the hardware's schedule of one CTA per tile: CTAs start in grid order, each on the first SM
that frees up, and a tile costs its kept blocks plus ``--overhead`` blocks of prologue and epilogue. Two grid
orders: the decoded order of ``tile_order.hpp`` (request, KV head, query tiles last first) and the work order of
``work_order.hpp`` (half-octave buckets of work, heaviest first, the decoded order within a bucket). Prints one
JSON line per shape: each order's makespan against the ideal (total work over the SMs), and the heaviest tile's
share of the ideal. A model, not a timing: it says whether a tail of heavy tiles started late explains what the
attention probes measure.

Usage (the four packages' ``src`` on ``PYTHONPATH``, on a CUDA GPU):
``python benchmarks/tile_schedule_model.py --shapes 16384:1:114688 131072:1:0``
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import json

import torch
from attention_switch_probe import recorded_attention_call  # this folder, first on sys.path when run as a script

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.kernel.triton.work_order import work_buckets
from fpv2.serving.pipeline import SparsePrefillPipeline


def makespan(costs: list[float], slots: int) -> float:
    """Finish time of a list schedule: each cost in turn starts on the slot that frees first."""
    free = [0.0] * slots
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def kept_blocks_per_tile(
    seqlen: int,
    batch: int,
    prefix: int,
    alpha: float,
    drift_tokens: float | None = None,
    *,
    backend: str = "hopper",
    device: str = "cuda",
) -> tuple[list[int], int, list[int]]:
    """Kept blocks of every tile in segment order (request, KV head, tile), the KV heads, tiles per request."""
    shape = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": 1}
    wl = planted_workload([seqlen] * batch, [prefix + seqlen] * batch, **shape, dtype=torch.bfloat16,
                          device=torch.device(device), drift_tokens=drift_tokens)  # fmt: skip
    pipe = SparsePrefillPipeline(SelectionConfig(alpha=alpha), correction=False, backend=backend)
    run, args, kwargs = recorded_attention_call(pipe, wl)
    index = inspect.signature(run).bind(*args, **kwargs).arguments["index"]
    tiles = index.tile_offsets.diff().tolist()
    num_segments = index.num_kv_heads * sum(tiles)
    kept = index.offsets[: num_segments + 1].diff().tolist()
    return kept, index.num_kv_heads, tiles


def decoded_order(num_kv_heads: int, tiles_per_request: list[int]) -> list[int]:
    """Segment ids in the grid order of tile_order.hpp (head-major): request, KV head, last query tile first."""
    order, base = [], 0
    for tiles in tiles_per_request:
        for head in range(num_kv_heads):
            first = base + head * tiles
            order.extend(range(first + tiles - 1, first - 1, -1))
        base += num_kv_heads * tiles
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", required=True, help="SEQLEN:BATCH:PREFIX per call")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--drift-tokens", type=float, default=None, help="the drifting background (planted_workload)")
    parser.add_argument("--overhead", type=float, default=2.0, help="a tile's fixed cost, in kept blocks")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tile_schedule_model needs a CUDA GPU (the index stage on the planted workload)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for spec in args.shapes:
        seqlen, batch, prefix = (int(part) for part in spec.split(":"))
        kept, num_kv_heads, tiles = kept_blocks_per_tile(seqlen, batch, prefix, args.alpha, args.drift_tokens)
        decoded = decoded_order(num_kv_heads, tiles)
        bucket = work_buckets(torch.tensor(kept)).tolist()  # work_order.hpp's buckets
        by_work = sorted(decoded, key=lambda s: -bucket[s])  # stable: decoded order within a bucket
        cost = [k + args.overhead for k in kept]
        ideal = sum(cost) / sms
        spans = {name: makespan([cost[s] for s in order], sms) for name, order in
                 (("decoded", decoded), ("work_order", by_work))}  # fmt: skip
        print(json.dumps({
            "seqlen": seqlen, "batch": batch, "prefix": prefix, "drift_tokens": args.drift_tokens, "sms": sms,
            "tiles": len(kept),
            "kept_mean": round(sum(kept) / len(kept), 1), "kept_max": max(kept),
            "heaviest_share_of_ideal": round(max(cost) / ideal, 3),
            "makespan_over_ideal": {name: round(span / ideal, 3) for name, span in spans.items()},
            "work_order_over_decoded": round(spans["work_order"] / spans["decoded"], 3),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
