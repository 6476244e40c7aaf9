"""Pooled block statistics of a paged KV cache: the pairs ``(kbar_J, vbar_J)`` and block lengths."""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import ACTIVATION_DTYPES, BlockStatistics, PagedPrefillBatch
from fpv2.kernel.reference.pooling import pool_blocks


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_cache(name: str, cache: object, batch: PagedPrefillBatch) -> torch.Tensor:
    """A cache must be ``(num_pages, page_size, Hkv, d)`` of an activation dtype, on the batch's device."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"{name} must have dtype in {ACTIVATION_DTYPES}; got {_describe(cache)}")
    if cache.dim() != 4 or tuple(cache.shape[:2]) != (batch.num_pages, batch.page_size):
        raise ValueError(
            f"{name} must have shape ({batch.num_pages}, {batch.page_size}, Hkv, d) (num_pages, page_size of the "
            f"batch); got {_describe(cache)}"
        )
    if cache.device != batch.device:
        raise ValueError(f"{name} must be on the batch's device {batch.device}; got {_describe(cache)}")
    return cache


def _check_descale(name: str, scale: object, fp8: bool, batch: PagedPrefillBatch, num_kv_heads: int) -> None:
    """FP8 caches need ``(B, Hkv) float32`` descales; other dtypes refuse them."""
    if scale is None:
        if fp8:
            raise ValueError(
                f"{name} is required for float8_e4m3fn caches (shape ({batch.num_requests}, {num_kv_heads}))"
            )
        return
    if not fp8:
        raise ValueError(f"{name} is only meaningful for float8_e4m3fn caches")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = _describe(scale) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name} must be a float32 tensor of shape ({batch.num_requests}, {num_kv_heads}); got {got}")
    if tuple(scale.shape) != (batch.num_requests, num_kv_heads) or scale.device != batch.device:
        raise ValueError(
            f"{name} must have shape ({batch.num_requests}, {num_kv_heads}) on {batch.device}; got {_describe(scale)}"
        )


def compute_block_statistics(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    block_size: int = 128,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> BlockStatistics:
    """Pool every key block of every request of ``batch`` (keys and values), reading through the page table.

    Each block's pooled key and value are the fp32 means over its valid tokens
    (a request's tail block averages over its real length). FP8 caches are
    dequantised with the per (request, KV head) descales first, so the result is
    in real units, as :class:`~fpv2.kernel.BlockStatistics` specifies.

    Args:
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        v_cache: ``(num_pages, page_size, Hkv, d)`` paged values, same dtype.
        batch: the paged prefill batch.
        block_size: tokens per block, a power of two (the index's block size).
        k_descale: ``(B, Hkv) float32`` key descales, required for FP8 caches.
        v_descale: ``(B, Hkv) float32`` value descales, required for FP8 caches.

    Returns:
        The :class:`~fpv2.kernel.BlockStatistics` (values checked).

    Raises:
        TypeError: wrong type or dtype, naming the argument.
        ValueError: inconsistent shape, device, block size or descales, naming the argument.
    """
    if not isinstance(batch, PagedPrefillBatch):
        raise TypeError(f"batch must be a PagedPrefillBatch, got {type(batch).__name__}")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size}")
    _check_cache("k_cache", k_cache, batch)
    _check_cache("v_cache", v_cache, batch)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must match; got k_cache {_describe(k_cache)}, v_cache {_describe(v_cache)}"
        )
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _check_descale("k_descale", k_descale, fp8, batch, k_cache.shape[2])
    _check_descale("v_descale", v_descale, fp8, batch, k_cache.shape[2])
    stats = pool_blocks(k_cache, v_cache, batch, block_size=block_size, k_descale=k_descale, v_descale=v_descale)
    # Re-run the contract's value checks (offsets, lengths) on what the pooling produced.
    return BlockStatistics(
        stats.pooled_k, stats.pooled_v, stats.block_lengths, stats.block_offsets, stats.block_size, check_values=True
    )
