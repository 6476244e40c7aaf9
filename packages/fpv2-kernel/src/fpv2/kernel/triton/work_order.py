"""Kept-block work order of the Triton kernel's programs: heaviest segments first, built on the device.

One program per segment (request, KV head, query tile) runs in grid order as SMs free up, so a heavy segment
started late runs alone at the end of the call. The index's dense tail (``SelectionConfig.dense_tail_tiles``:
the last query tile of every request and KV head keeps its whole span) makes such segments: after a 112K
prefix one keeps ~1,000 blocks against a mean of ~27. The Hopper kernel's work order (``work_order.hpp``) took
10-42% off its chunks after a prefix (benchmarks/results/2026-12-06-h100-default-schedule/). This is the same
order for the Triton kernel: segments sorted by half-octave buckets of their kept-block count (the Hopper
kernel's buckets), heaviest first, and within a bucket last to first (the reverse grid's order, which keeps
the segments of one KV head together for L2). One ``torch.argsort`` on the device; no host sync.

Opt-in (``FPV2_TRITON_WORK_ORDER=1``) until it is timed on a GPU.
"""

from __future__ import annotations

import os

import torch

#: Environment switch of the work order: "1" on; unset, "" or "0" off.
WORK_ORDER_ENV = "FPV2_TRITON_WORK_ORDER"
#: Buckets of work, as ``kWorkBuckets`` of csrc/hopper/work_order.hpp (the last one holds 2^15 blocks and more).
WORK_BUCKETS = 32


def work_order_requested() -> bool:
    """Whether ``FPV2_TRITON_WORK_ORDER`` asks for the work order.

    Raises:
        ValueError: the variable holds something other than "", "0" or "1".
    """
    value = os.environ.get(WORK_ORDER_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"environment {WORK_ORDER_ENV}={value}: expected 0 or 1 (unset: 0)")
    return value == "1"


def work_buckets(kept: torch.Tensor) -> torch.Tensor:
    """Half-octave bucket of each kept-block count: 0 for none, else ``1 + 2 e + h`` for ``2^e <= n < 2^(e+1)``,
    ``h`` the bit below the leading one, capped at ``WORK_BUCKETS - 1`` (``work_bucket`` of work_order.hpp).

    Args:
        kept: integer tensor of counts (any shape, non-negative).

    Returns:
        int64 tensor of buckets, the shape of ``kept``.
    """
    mantissa, exponent = torch.frexp(kept.to(torch.float64).clamp(min=1.0))  # n = m 2^k, m in [0.5, 1)
    bucket = 1 + 2 * (exponent.to(torch.int64) - 1) + (mantissa >= 0.75).to(torch.int64)
    return torch.where(kept > 0, bucket.clamp(max=WORK_BUCKETS - 1), torch.zeros_like(bucket))


def segment_work_order(offsets: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The grid's permutation: program ``i`` computes segment ``order[i]``.

    Args:
        offsets: the block index's CSR offsets, ``(S + 1,) int32`` (``BlockIndex.offsets``).
        num_segments: ``S``.

    Returns:
        ``(S,) int32`` on the offsets' device: segments by decreasing bucket of kept blocks, and within a bucket
        by decreasing segment id.
    """
    kept = offsets[1 : num_segments + 1] - offsets[:num_segments]
    segment = torch.arange(num_segments, device=offsets.device, dtype=torch.int64)
    key = work_buckets(kept) * num_segments + segment  # unique: the order is deterministic
    return torch.argsort(key, descending=True).to(torch.int32)
