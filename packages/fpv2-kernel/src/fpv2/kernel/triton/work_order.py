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
attention launch, mean correction, in one process): with the full bucket sort, chunks after a prefix with their
dense tail -15.8 to -31.6%, fresh 32K -5.7%, 128K -0.6%, but fresh 8K +9.6% and chunks without a dense tail
(the chunk-aware pipeline's middle chunks) +4.8 to +14.1%: there the sort only separates the segments of one KV
head, which share blocks in L2. So by default (``FPV2_TRITON_WORK_ORDER`` unset, :func:`use_work_order`) calls
with a cached prefix and more segments than SMs are ordered and fresh calls are not. With
``FPV2_TRITON_ORDER_LIGHT_BLOCKS=N`` (:func:`light_blocks`) only segments that keep at least ``N`` blocks are
sorted (heaviest first) and the others follow in the decoded order, which leaves a chunk without a dense tail in
the decoded order; not yet timed, so the default sorts every segment (0), as measured.
"""

from __future__ import annotations

import os

import torch

#: Environment switch of the work order: "1" on, "0" off; unset or "": :func:`use_work_order`'s rule.
WORK_ORDER_ENV = "FPV2_TRITON_WORK_ORDER"
#: Environment override of :data:`DEFAULT_LIGHT_BLOCKS` (an integer, 0 = sort every segment by its bucket).
LIGHT_BLOCKS_ENV = "FPV2_TRITON_ORDER_LIGHT_BLOCKS"
#: Segments that keep fewer blocks than this keep the decoded order, after the heavier ones (0: none). A dense-tail
#: segment keeps its whole span (64 blocks after an 8K prefix), the planted workload's others 11-30 on average:
#: 64 is the value to time (``benchmarks/attention_schedule_device_run.sh triton-even``).
DEFAULT_LIGHT_BLOCKS = 0
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


def light_blocks() -> int:
    """The light-segment bound: ``FPV2_TRITON_ORDER_LIGHT_BLOCKS`` if set, else :data:`DEFAULT_LIGHT_BLOCKS`.

    Raises:
        ValueError: the variable is not an integer in 0..2^20.
    """
    value = os.environ.get(LIGHT_BLOCKS_ENV, "")
    if value == "":
        return DEFAULT_LIGHT_BLOCKS
    if not value.isdigit() or int(value) > 1 << 20:
        raise ValueError(f"environment {LIGHT_BLOCKS_ENV}={value}: expected an integer in 0..{1 << 20}")
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


def segment_work_order(offsets: torch.Tensor, num_segments: int, *, light: int = 0) -> torch.Tensor:
    """The grid's permutation: program ``i`` computes segment ``order[i]``.

    Args:
        offsets: the block index's CSR offsets, ``(S + 1,) int32`` (``BlockIndex.offsets``).
        num_segments: ``S``.
        light: segments that keep fewer blocks share the lowest place (0: every segment by its bucket).

    Returns:
        ``(S,) int32`` on the offsets' device: segments by decreasing bucket of kept blocks, and within a bucket
        (the light segments' included) by decreasing segment id, the decoded order of the kernel's reversed grid.
    """
    kept = offsets[1 : num_segments + 1] - offsets[:num_segments]
    segment = torch.arange(num_segments, device=offsets.device, dtype=torch.int64)
    buckets = work_buckets(kept)
    if light > 0:
        buckets = torch.where(kept >= light, buckets, torch.zeros_like(buckets))
    key = buckets * num_segments + segment  # unique: the order is deterministic
    return torch.argsort(key, descending=True).to(torch.int32)
