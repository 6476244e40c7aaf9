"""Time of the Triton kernel's work order: the one-launch counting sort against the ``torch.argsort`` reference.

For each segment count, offsets of a chunk-like index (most segments keep 10-60 blocks, one in ``--tail-every``
keeps a dense-tail span of ``--tail-blocks``) are built on the GPU; ``segment_work_order`` (one Triton launch) and
``segment_work_order_reference`` (``torch.argsort``) are checked equal, then timed: eager calls (CUDA events around
one synchronised call, host time included, as the attention launch sees it) and back-to-back calls (``--calls``
between two events). Writes JSON lines to stdout.

Usage (the packages' ``src`` on ``PYTHONPATH``, on a GPU):
``python benchmarks/work_order_speed.py --segments 2048 4096 32768``
"""

from __future__ import annotations

import argparse
import json

import torch
from attention_switch_probe import timed  # this folder, first on sys.path as a script

from fpv2.kernel.triton.work_order import segment_work_order, segment_work_order_reference
from fpv2.serving.timing import median, timed_samples


def chunk_like_offsets(num_segments: int, tail_every: int, tail_blocks: int, device: torch.device) -> torch.Tensor:
    """CSR offsets of ``num_segments`` segments: 10-60 kept blocks each, every ``tail_every``-th a dense tail."""
    generator = torch.Generator().manual_seed(num_segments)
    kept = torch.randint(10, 60, (num_segments,), generator=generator)
    kept[tail_every - 1 :: tail_every] = tail_blocks
    offsets = torch.zeros(num_segments + 1, dtype=torch.int32)
    offsets[1:] = kept.cumsum(0)
    return offsets.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--segments", type=int, nargs="+", default=[2048, 4096, 32768])
    parser.add_argument("--tail-every", type=int, default=256, help="one dense-tail segment per this many")
    parser.add_argument("--tail-blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    device = torch.device("cuda")
    for num_segments in args.segments:
        offsets = chunk_like_offsets(num_segments, args.tail_every, args.tail_blocks, device)
        kernel_order = segment_work_order(offsets, num_segments)
        row = {
            "segments": num_segments,
            "equal": torch.equal(kernel_order, segment_work_order_reference(offsets, num_segments)),
        }
        for name, fn in (("kernel", segment_work_order), ("argsort", segment_work_order_reference)):

            def call(fn=fn, offsets=offsets, num_segments=num_segments) -> torch.Tensor:
                return fn(offsets, num_segments)

            samples, _ = timed_samples(call, 5, args.repeats, device)
            row[f"{name}_eager_ms"] = round(median(samples), 4)
            row[f"{name}_back_to_back_ms"] = round(timed(call, args.calls), 4)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
