"""The key spread of every block (variance per dimension and radius around its pooled mean), in Triton.

What a :class:`~fpv2.kernel.CorrectionPlan` with a ``key_spread`` needs on a GPU:
one pass over the keys, through the page table, after the pooling has produced the
block means. Each program takes one (block, request, KV head), walks the block's
tokens in chunks and subtracts the mean before squaring, so the variance has no
fp32 cancellation (the one-pass ``E|k|^2 - |kbar|^2`` loses it for keys far from
the origin). Same numbers as :func:`fpv2.correction.compute_key_spread`, without
its host loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contracts import ACTIVATION_DTYPES, BlockStatistics, KeySpread, PagedPrefillBatch, num_key_blocks
from ..contracts._checks import check_last_dim_contiguous, check_shape, check_tensor, describe
from ..contracts.prefill_inputs import check_descale

#: Tokens of a block read per step.
TOKENS_PER_STEP = 32


@triton.jit
def key_spread_kernel(
    K,
    PageTable,
    SeqlensK,
    BlockOffsets,
    PooledK,
    KDescale,
    Variance,
    Radius,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_pt,
    stride_pb,
    stride_ph,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    FP8: tl.constexpr,
):
    """Variance and radius of block ``program_id(0)`` of request ``program_id(1)``, KV head ``program_id(2)``."""
    j = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kv_len = tl.load(SeqlensK + b)
    start = j * BLOCK_SIZE
    if start < kv_len:
        row = tl.load(BlockOffsets + b) + j
        offs_d = tl.arange(0, HEAD_DIM)
        mean = tl.load(PooledK + row.to(tl.int64) * stride_pb + h * stride_ph + offs_d)
        pt_row = PageTable + b.to(tl.int64) * stride_pt
        total = 0.0
        peak = 0.0
        for c in range(0, BLOCK_SIZE, TOKENS):
            pos = start + c + tl.arange(0, TOKENS)
            ok = pos < kv_len
            page = tl.load(pt_row + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
            ptrs = K + (page * stride_kp + (pos % PAGE_SIZE) * stride_ks + h * stride_kh)[:, None] + offs_d[None, :]
            k = tl.load(ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
            if FP8:
                k = k * tl.load(KDescale + b * NUM_KV_HEADS + h)
            diff = k - mean[None, :]
            dist2 = tl.where(ok, tl.sum(diff * diff, 1), 0.0)
            total += tl.sum(dist2, 0)
            peak = tl.maximum(peak, tl.max(dist2, 0))
        count = tl.minimum(kv_len - start, BLOCK_SIZE)
        tl.store(Variance + row * NUM_KV_HEADS + h, total / (count * HEAD_DIM).to(tl.float32))
        tl.store(Radius + row * NUM_KV_HEADS + h, tl.sqrt(peak))


def key_spread_triton(
    k_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics,
    *,
    k_descale: torch.Tensor | None = None,
) -> KeySpread:
    """The :class:`~fpv2.kernel.KeySpread` of every key block of ``batch``, on the device (no host sync).

    Args:
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys (bf16, fp16, e4m3 or fp32), unit stride
            along ``d``.
        batch: the paged prefill batch.
        statistics: the batch's pooled statistics (their pooled keys are the block means).
        k_descale: ``(B, Hkv) float32`` key descales, required for (and only for) FP8 caches.

    Returns:
        The spread, ``(total_blocks, Hkv) float32`` variance and radius on the cache's device.

    Raises:
        TypeError, ValueError: a wrong argument, named with its shape and dtype.
    """
    if not isinstance(batch, PagedPrefillBatch):
        raise TypeError(f"batch must be a PagedPrefillBatch, got {type(batch).__name__}")
    if not isinstance(statistics, BlockStatistics):
        raise TypeError(f"statistics must be a BlockStatistics, got {type(statistics).__name__}")
    check_tensor("k_cache", k_cache, dtypes=ACTIVATION_DTYPES, ndim=4, device=batch.device)
    check_shape("k_cache", k_cache, (batch.num_pages, batch.page_size, None, None))
    check_last_dim_contiguous("k_cache", k_cache)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_descale("k_descale", k_descale, k_cache.dtype, batch, num_kv_heads)
    if tuple(statistics.pooled_k.shape[1:]) != (num_kv_heads, head_dim) or statistics.pooled_k.device != k_cache.device:
        raise ValueError(
            f"statistics pooled_k {describe(statistics.pooled_k)} does not fit k_cache {describe(k_cache)}"
        )
    blocks = [num_key_blocks(n, statistics.block_size) for n in batch.host.seqlens_k]
    if statistics.pooled_k.shape[0] != sum(blocks) or statistics.block_offsets.numel() != batch.num_requests + 1:
        raise ValueError(
            f"statistics hold {statistics.pooled_k.shape[0]} blocks and {statistics.block_offsets.numel()} offsets; "
            f"the batch needs {sum(blocks)} blocks of {statistics.block_size} tokens and {batch.num_requests + 1}"
        )
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    total = statistics.pooled_k.shape[0]
    variance = torch.zeros(total, num_kv_heads, dtype=torch.float32, device=k_cache.device)
    radius = torch.zeros_like(variance)
    if total:
        pooled_k = statistics.pooled_k
        key_spread_kernel[(max(blocks), batch.num_requests, num_kv_heads)](
            k_cache,
            batch.page_table,
            batch.seqlens_k,
            statistics.block_offsets,
            pooled_k,
            k_descale.contiguous() if fp8 else variance,
            variance,
            radius,
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            batch.page_table.stride(0),
            pooled_k.stride(0),
            pooled_k.stride(1),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=statistics.block_size,
            PAGE_SIZE=batch.page_size,
            TOKENS=min(TOKENS_PER_STEP, statistics.block_size),
            FP8=fp8,
        )
    return KeySpread(variance=variance, radius=radius)
