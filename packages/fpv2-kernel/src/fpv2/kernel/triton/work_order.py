"""Kept-block work order of the Triton kernel's programs: heaviest segments first, built on the device.

One program per segment (request, KV head, query tile) runs in grid order as SMs free up, so a heavy segment
started late runs alone at the end of the call. The index's dense tail (``SelectionConfig.dense_tail_tiles``:
the last query tile of every request and KV head keeps its whole span) makes such segments: after a 112K
prefix one keeps ~1,000 blocks against a mean of ~27. The Hopper kernel's work order (``work_order.hpp``) took
10-42% off its chunks after a prefix (benchmarks/results/2026-12-06-h100-default-schedule/). This is the same
order for the Triton kernel: segments sorted by half-octave buckets of their kept-block count (the Hopper
kernel's buckets), heaviest first, and within a bucket last to first (the reverse grid's order, which keeps
the segments of one KV head together for L2). Built on the device with no host sync: by one small Triton launch (a
counting sort over the buckets, :func:`segment_work_order`) up to 8,192 segments, where it takes 0.06-0.10 ms
against 0.25 for ``torch.argsort`` of 64-bit keys (:func:`segment_work_order_reference`, used above that).

Measured on an H100 (``benchmarks/results/2026-12-06-h100-chunk-tile-pages/``, the planted pipeline's
attention launch, mean correction, in one process): with the full bucket sort, chunks after a prefix with their
dense tail -15.8 to -31.6%, fresh 32K -5.7%, 128K -0.6%, but fresh 8K +9.6% and chunks without a dense tail
(the chunk-aware pipeline's middle chunks) +4.8 to +14.1%. So by default (``FPV2_TRITON_WORK_ORDER`` unset,
:func:`use_work_order`) calls with a cached prefix and more segments than SMs are ordered and fresh calls are not.
Sorting only the segments that keep >= 64 blocks, which leaves such a chunk in the decoded order, cost the same
(+7.0 / +16.0% against +7.6 / +15.7%, ``benchmarks/results/2026-12-06-h100-fused-tile-copy/``): the cost there is
building and reading the order, not the order itself.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .interpreter_compat import install_interpreter_index_fix

#: Environment switch of the work order: "1" on, "0" off; unset or "": :func:`use_work_order`'s rule.
WORK_ORDER_ENV = "FPV2_TRITON_WORK_ORDER"
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


#: Segments per step of the order kernel's loops (a ``SEGMENTS x WORK_BUCKETS`` one-hot per step).
ORDER_SEGMENTS = 256
#: Above this many segments the order kernel's one program is slower than ``torch.argsort`` (H100, eager: 0.059
#: against 0.249 ms at 2,048 segments, 0.098 / 0.255 at 4,096, 0.341 / 0.297 at 16,384; results/2026-12-06-h100-
#: fused-tile-copy/), so larger grids are ordered by :func:`segment_work_order_reference`.
ORDER_KERNEL_MAX_SEGMENTS = 8192


@triton.jit
def _work_bucket(kept):
    """``work_buckets`` of an int32 block of counts, in integer arithmetic."""
    powers = tl.arange(0, 32)
    # floor(log2 n) for n >= 1: how many of 2, 4, ..., 2^31 are <= n.
    e = tl.sum(((kept[:, None] >> powers[None, :]) > 1).to(tl.int32), axis=1)
    half = tl.where(e > 0, (kept >> tl.maximum(e - 1, 0)) & 1, 0)
    bucket = tl.minimum(1 + 2 * e + half, 31)
    return tl.where(kept > 0, bucket, 0)


@triton.jit
def work_order_kernel(Offsets, Order, num_segments, SEGMENTS: tl.constexpr, BUCKETS: tl.constexpr):
    """One program: ``Order`` = segments by decreasing bucket, within a bucket by decreasing segment id.

    A counting sort: the buckets' sizes give each bucket's first place (heaviest first); then the segments are
    walked from the last, and segment ``s`` of bucket ``b`` goes to the bucket's first place plus the number of
    later segments in ``b``.
    """
    lanes = tl.arange(0, SEGMENTS)
    buckets = tl.arange(0, BUCKETS)
    sizes = tl.zeros([BUCKETS], dtype=tl.int32)
    for start in range(0, num_segments, SEGMENTS):
        seg = start + lanes
        ok = seg < num_segments
        kept = tl.load(Offsets + seg + 1, mask=ok, other=0) - tl.load(Offsets + seg, mask=ok, other=0)
        hot = (_work_bucket(kept)[:, None] == buckets[None, :]) & ok[:, None]
        sizes += tl.sum(hot.to(tl.int32), axis=0)
    # First place of bucket b: the segments of every heavier bucket.
    first = tl.sum(tl.where(buckets[None, :] > buckets[:, None], sizes[None, :], 0), axis=1)
    placed = tl.zeros([BUCKETS], dtype=tl.int32)  # segments of each bucket after the current step's
    steps = tl.cdiv(num_segments, SEGMENTS)
    for step in range(0, steps):
        start = (steps - 1 - step) * SEGMENTS
        seg = start + lanes
        ok = seg < num_segments
        kept = tl.load(Offsets + seg + 1, mask=ok, other=0) - tl.load(Offsets + seg, mask=ok, other=0)
        hot = ((_work_bucket(kept)[:, None] == buckets[None, :]) & ok[:, None]).to(tl.int32)
        counts = tl.sum(hot, axis=0)
        # Later segments of the same bucket within this step: the step's count less the inclusive prefix.
        later = tl.sum(hot * (counts[None, :] - tl.cumsum(hot, axis=0)), axis=1)
        place = tl.sum(hot * (first + placed)[None, :], axis=1) + later
        tl.store(Order + place, seg, mask=ok)
        placed += counts


#: The order kernel runs under the Triton interpreter (then on CPU tensors too).
_INTERPRETED = isinstance(work_order_kernel, InterpretedFunction)


def segment_work_order(offsets: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The grid's permutation: program ``i`` computes segment ``order[i]``.

    One Triton launch for up to :data:`ORDER_KERNEL_MAX_SEGMENTS` segments on CUDA (or under the interpreter);
    :func:`segment_work_order_reference` otherwise.

    Args:
        offsets: the block index's CSR offsets, ``(S + 1,) int32`` (``BlockIndex.offsets``).
        num_segments: ``S``.

    Returns:
        ``(S,) int32`` on the offsets' device: segments by decreasing bucket of kept blocks, and within a bucket
        by decreasing segment id, the decoded order of the kernel's reversed grid.
        :func:`segment_work_order_reference` gives the same.
    """
    if num_segments > ORDER_KERNEL_MAX_SEGMENTS or not (offsets.is_cuda or _INTERPRETED):
        return segment_work_order_reference(offsets, num_segments)
    if _INTERPRETED:
        install_interpreter_index_fix()  # its loops run to a bound known at run time
    order = torch.empty(num_segments, dtype=torch.int32, device=offsets.device)
    if num_segments > 0:
        work_order_kernel[(1,)](offsets, order, num_segments, SEGMENTS=ORDER_SEGMENTS, BUCKETS=WORK_BUCKETS)
    return order


def segment_work_order_reference(offsets: torch.Tensor, num_segments: int) -> torch.Tensor:
    """:func:`segment_work_order` by ``torch.argsort`` (the specification its kernel is tested against).

    Args:
        offsets: the block index's CSR offsets, ``(S + 1,) int32`` (``BlockIndex.offsets``).
        num_segments: ``S``.

    Returns:
        ``(S,) int32`` on the offsets' device: segments by decreasing bucket of kept blocks, and within a bucket
        by decreasing segment id, the decoded order of the kernel's reversed grid.
    """
    kept = offsets[1 : num_segments + 1] - offsets[:num_segments]
    segment = torch.arange(num_segments, device=offsets.device, dtype=torch.int64)
    buckets = work_buckets(kept)
    key = buckets * num_segments + segment  # unique: the order is deterministic
    return torch.argsort(key, descending=True).to(torch.int32)
