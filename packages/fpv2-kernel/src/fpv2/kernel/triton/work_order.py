"""Kept-block work order of the Triton kernel's programs: heaviest segments first, built on the device.

One program per segment (request, KV head, query tile) runs in grid order as SMs free up, so a heavy segment
started late runs alone at the end of the call. The index's dense tail (``SelectionConfig.dense_tail_tiles``:
the last query tile of every request and KV head keeps its whole span) makes such segments: after a 112K
prefix one keeps ~1,000 blocks against a mean of ~27. The Hopper kernel's work order (``work_order.hpp``) took
10-42% off its chunks after a prefix (benchmarks/results/2026-12-06-h100-default-schedule/). This is the same
order for the Triton kernel: segments sorted by half-octave buckets of their kept-block count (the Hopper
kernel's buckets), heaviest first, and within a bucket last to first (the reverse grid's order, which keeps
the segments of one KV head together for L2). One ``torch.argsort`` on the device; no host sync.

Measured on an H100 (``benchmarks/results/2026-12-06-h100-chunk-tile-pages/``, the planted pipeline's
attention launch, mean correction, in one process): chunks after a prefix with their dense tail -15.8 to -30.8%,
fresh 32K -5.7%, 128K -0.6%, but fresh 8K +9.6% and a chunk without a dense tail +6.3%. So by default
(``FPV2_TRITON_WORK_ORDER`` unset, :func:`use_work_order`) calls with a cached prefix and more segments than SMs
sort, as the Hopper kernel's default schedule does, and a call whose heaviest segment keeps fewer than
``FPV2_TRITON_ORDER_EVEN_RATIO`` times the mean (:func:`even_ratio`) keeps the decoded order: there the sort
only separates the segments that share blocks.
"""

from __future__ import annotations

import os

import torch

#: Environment switch of the work order: "1" on, "0" off; unset or "": :func:`use_work_order`'s rule.
WORK_ORDER_ENV = "FPV2_TRITON_WORK_ORDER"
#: Environment override of :data:`DEFAULT_EVEN_RATIO` (an integer, 0 = always sort).
EVEN_RATIO_ENV = "FPV2_TRITON_ORDER_EVEN_RATIO"
#: A call keeps the decoded order when its heaviest segment's bucket floor is below this many times the mean
#: bucket floor of its segments (0: always sort).
DEFAULT_EVEN_RATIO = 0
#: Buckets of work, as ``kWorkBuckets`` of csrc/hopper/work_order.hpp (the last one holds 2^15 blocks and more).
WORK_BUCKETS = 32


def work_order_mode() -> str:
    """``FPV2_TRITON_WORK_ORDER``: ``"1"`` (always), ``"0"`` (never) or ``"auto"`` (unset or empty).

    Raises:
        ValueError: the variable holds something else.
    """
    value = os.environ.get(WORK_ORDER_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"environment {WORK_ORDER_ENV}={value}: expected 0 or 1 (unset: the automatic rule)")
    return value or "auto"


def use_work_order(q_lens: list[int], seqlens_k: list[int], num_segments: int, device: torch.device) -> bool:
    """Whether a block-sparse call runs its programs in the work order.

    ``auto``: when some request has a cached prefix (``seqlens_k > q_len``) and the grid has more programs
    than the device has SMs (on the CPU, any number): a chunk after a prefix has its dense-tail segments, the
    heaviest of the call, late in the decoded order.

    Args:
        q_lens: queries per request (the batch's host view).
        seqlens_k: KV lengths per request.
        num_segments: programs of the grid.
        device: the call's device.

    Returns:
        True to order the grid.

    Raises:
        ValueError: an invalid ``FPV2_TRITON_WORK_ORDER``.
    """
    mode = work_order_mode()
    if mode != "auto":
        return mode == "1"
    if not any(k > q for q, k in zip(q_lens, seqlens_k)):
        return False
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    return num_segments > sms


def even_ratio() -> int:
    """The even-call ratio: ``FPV2_TRITON_ORDER_EVEN_RATIO`` if set, else :data:`DEFAULT_EVEN_RATIO`.

    Raises:
        ValueError: the variable is not an integer in 0..1024.
    """
    value = os.environ.get(EVEN_RATIO_ENV, "")
    if value == "":
        return DEFAULT_EVEN_RATIO
    if not value.isdigit() or int(value) > 1024:
        raise ValueError(f"environment {EVEN_RATIO_ENV}={value}: expected an integer in 0..1024")
    return int(value)


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


def bucket_floors(buckets: torch.Tensor) -> torch.Tensor:
    """Fewest kept blocks of each bucket (:func:`work_buckets`' inverse floor; 0 for bucket 0).

    Args:
        buckets: int64 buckets.

    Returns:
        int64 tensor, the shape of ``buckets``.
    """
    e = (buckets - 1).clamp(min=0) // 2
    half = (buckets - 1).clamp(min=0) % 2
    floor = torch.bitwise_left_shift(torch.ones_like(e), e) + torch.where(
        e > 0, torch.bitwise_left_shift(half, (e - 1).clamp(min=0)), torch.zeros_like(e)
    )
    return torch.where(buckets > 0, floor, torch.zeros_like(floor))


def segment_work_order(
    offsets: torch.Tensor, num_segments: int, *, even_ratio: int = 0, reverse: bool = True
) -> torch.Tensor:
    """The grid's permutation: program ``i`` computes segment ``order[i]``.

    Args:
        offsets: the block index's CSR offsets, ``(S + 1,) int32`` (``BlockIndex.offsets``).
        num_segments: ``S``.
        even_ratio: keep the decoded order when the heaviest segment's bucket floor is below this many times
            the mean floor of the segments that keep blocks (decided on the device; 0: always sort).
        reverse: the decoded order runs the segments last to first (the kernel's ``reverse_grid``).

    Returns:
        ``(S,) int32`` on the offsets' device: segments by decreasing bucket of kept blocks, and within a bucket
        by decreasing segment id; or the decoded order for an even call.
    """
    kept = offsets[1 : num_segments + 1] - offsets[:num_segments]
    segment = torch.arange(num_segments, device=offsets.device, dtype=torch.int64)
    buckets = work_buckets(kept)
    key = buckets * num_segments + segment  # unique: the order is deterministic
    order = torch.argsort(key, descending=True)
    if even_ratio > 0:
        floors = bucket_floors(buckets)
        tiles = (buckets > 0).sum()
        even = (tiles > 0) & (floors.max() * tiles < even_ratio * floors.sum())  # a device scalar: no sync
        order = torch.where(even, segment.flip(0) if reverse else segment, order)
    return order.to(torch.int32)
