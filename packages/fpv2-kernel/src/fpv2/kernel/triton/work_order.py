"""Kept-block work order of the Triton kernel's programs: heaviest segments first, built on the device.

One program per segment (request, KV head, query tile) runs in grid order as SMs free up, so a heavy segment
started late runs alone at the end of the call. The index's dense tail (``SelectionConfig.dense_tail_tiles``:
the last query tile of every request and KV head keeps its whole span) makes such segments: after a 112K
prefix one keeps ~1,000 blocks against a mean of ~27. The Hopper kernel's work order (``work_order.hpp``) took
10-42% off its chunks after a prefix (benchmarks/results/2026-12-06-h100-default-schedule/). This is the same
order for the Triton kernel: segments sorted by half-octave buckets of their kept-block count (the Hopper
kernel's buckets), heaviest first, and within a bucket last to first (the reverse grid's order, which keeps
the segments of one KV head together for L2). Built on the device with no host sync by a counting sort over the
buckets in two small Triton launches (:func:`segment_work_order`); ``torch.argsort`` of 64-bit keys
(:func:`segment_work_order_reference`, the specification) took 0.25-0.33 ms at 2-32K segments on an H100.

Measured on an H100 (the planted pipeline's attention launch, mean correction, order on against off in one
process). With the argsort order (``benchmarks/results/2026-12-06-h100-chunk-tile-pages/``): chunks after a prefix
with their dense tail -15.8 to -31.6%, fresh 32K -5.7%, 128K -0.6%, but fresh 8K +9.6% and chunks without a dense
tail (the chunk-aware pipeline's middle chunks) +4.8 to +14.1%, most of it the argsort's ~0.25 ms; only calls with a
cached prefix were ordered then. With the two launches (``benchmarks/results/2026-12-06-h100-fused-tile-copy/``):
16K after 112K -33.9%, 2K after 126K -12.2%, fresh 8K -3.5%, 32K -11.0%, 128K -1.5%, 4 x 32K -1.5%, chunks
without a dense tail +1.8 / +3.9%. So every call with more segments than SMs is ordered (:func:`use_work_order`;
``FPV2_TRITON_WORK_ORDER`` 0 / 1 overrides). Sorting only the segments that keep >= 64 blocks cost the same as
the full sort: what chunks without a tail pay is building and reading the order, not the order itself.
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


def use_work_order(num_segments: int, device: torch.device) -> bool:
    """Whether a block-sparse call runs its programs in the work order.

    ``auto``: when the grid has more programs than the device has SMs (on the CPU, any program): every call with a
    dense tail has segments far heavier than the mean, late in the decoded order. Measured on an H100 with the
    order built in two launches (``benchmarks/results/2026-12-06-h100-fused-tile-copy/``): fresh 8K -3.5%, 32K
    -11.0%, 128K -1.5%, 4 x 32K -1.5%; chunks after a prefix -12 to -34%; chunks without a dense tail +1.8 / +3.9%.

    Args:
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


#: Segments per program of the order kernels (a ``SEGMENTS x WORK_BUCKETS`` one-hot each).
ORDER_SEGMENTS = 256
#: Rows of per-program counts the placing kernel reads at a time.
_COUNT_ROWS = 64


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
def _bucket_one_hot(Offsets, start, num_segments, SEGMENTS: tl.constexpr, BUCKETS: tl.constexpr):
    """Segments ``start ..`` of a program, whether each exists, and the ``SEGMENTS x BUCKETS`` one-hot of buckets."""
    seg = start + tl.arange(0, SEGMENTS)
    ok = seg < num_segments
    kept = tl.load(Offsets + seg + 1, mask=ok, other=0) - tl.load(Offsets + seg, mask=ok, other=0)
    hot = (_work_bucket(kept)[:, None] == tl.arange(0, BUCKETS)[None, :]) & ok[:, None]
    return seg, ok, hot.to(tl.int32)


@triton.jit
def bucket_counts_kernel(Offsets, Counts, num_segments, SEGMENTS: tl.constexpr, BUCKETS: tl.constexpr):
    """``Counts[p, b]``: segments of program ``p``'s ``SEGMENTS`` that fall in bucket ``b``."""
    pid = tl.program_id(0)
    _seg, _ok, hot = _bucket_one_hot(Offsets, pid * SEGMENTS, num_segments, SEGMENTS, BUCKETS)
    tl.store(Counts + pid * BUCKETS + tl.arange(0, BUCKETS), tl.sum(hot, axis=0))


@triton.jit
def place_segments_kernel(
    Offsets,
    Counts,
    Order,
    num_segments,
    num_programs,
    SEGMENTS: tl.constexpr,
    BUCKETS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Write each segment of program ``p`` to its place: segments by decreasing bucket, then decreasing id.

    A counting sort: segment ``s`` of bucket ``b`` goes after every segment of a heavier bucket, then after the
    segments of ``b`` with a higher id (those of later programs, from ``Counts``, and those later in its own).
    """
    pid = tl.program_id(0)
    buckets = tl.arange(0, BUCKETS)
    sizes = tl.zeros([BUCKETS], dtype=tl.int32)
    after = tl.zeros([BUCKETS], dtype=tl.int32)  # segments of each bucket in later programs
    for row0 in range(0, num_programs, ROWS):
        rows = row0 + tl.arange(0, ROWS)
        counts = tl.load(
            Counts + rows[:, None] * BUCKETS + buckets[None, :], mask=rows[:, None] < num_programs, other=0
        )
        sizes += tl.sum(counts, axis=0)
        after += tl.sum(tl.where(rows[:, None] > pid, counts, 0), axis=0)
    first = tl.sum(tl.where(buckets[None, :] > buckets[:, None], sizes[None, :], 0), axis=1)  # heavier buckets
    seg, ok, hot = _bucket_one_hot(Offsets, pid * SEGMENTS, num_segments, SEGMENTS, BUCKETS)
    own = tl.sum(hot, axis=0)
    later = tl.sum(hot * (own[None, :] - tl.cumsum(hot, axis=0)), axis=1)  # same bucket, later in this program
    place = tl.sum(hot * (first + after)[None, :], axis=1) + later
    tl.store(Order + place, seg, mask=ok)


#: Whether the order kernels run under the Triton interpreter (then on CPU tensors too); read at the first call.
_INTERPRETED: bool | None = None


def _interpreted() -> bool:
    """Whether the order kernels are interpreted (asked once: the kernels are decorated at import)."""
    global _INTERPRETED
    if _INTERPRETED is None:
        _INTERPRETED = isinstance(place_segments_kernel, InterpretedFunction)
    return _INTERPRETED


def segment_work_order(offsets: torch.Tensor, num_segments: int) -> torch.Tensor:
    """The grid's permutation: program ``i`` computes segment ``order[i]``.

    Two Triton launches on CUDA (or under the interpreter): per ``ORDER_SEGMENTS`` segments their bucket counts,
    then each segment's place; :func:`segment_work_order_reference` on CPU tensors otherwise.

    Args:
        offsets: the block index's CSR offsets, ``(S + 1,) int32`` (``BlockIndex.offsets``).
        num_segments: ``S``.

    Returns:
        ``(S,) int32`` on the offsets' device: segments by decreasing bucket of kept blocks, and within a bucket
        by decreasing segment id, the decoded order of the kernel's reversed grid.
        :func:`segment_work_order_reference` gives the same.
    """
    interpreted = _interpreted()
    if not (offsets.is_cuda or interpreted):
        return segment_work_order_reference(offsets, num_segments)
    if interpreted:
        install_interpreter_index_fix()  # the placing kernel loops to a bound known at run time
    programs = -(-num_segments // ORDER_SEGMENTS)
    # One allocation for the order and the per-program counts.
    scratch = torch.empty(num_segments + programs * WORK_BUCKETS, dtype=torch.int32, device=offsets.device)
    order, counts = scratch[:num_segments], scratch[num_segments:]
    if programs > 0:
        meta = {"SEGMENTS": ORDER_SEGMENTS, "BUCKETS": WORK_BUCKETS}
        bucket_counts_kernel[(programs,)](offsets, counts, num_segments, **meta)
        place_segments_kernel[(programs,)](offsets, counts, order, num_segments, programs, ROWS=_COUNT_ROWS, **meta)
    return order


def segment_work_order_reference(offsets: torch.Tensor, num_segments: int) -> torch.Tensor:
    """:func:`segment_work_order` by ``torch.argsort``: the specification its kernels are tested against.

    Arguments and result as for :func:`segment_work_order`.
    """
    kept = offsets[1 : num_segments + 1] - offsets[:num_segments]
    segment = torch.arange(num_segments, device=offsets.device, dtype=torch.int64)
    buckets = work_buckets(kept)
    key = buckets * num_segments + segment  # unique: the order is deterministic
    return torch.argsort(key, descending=True).to(torch.int32)
