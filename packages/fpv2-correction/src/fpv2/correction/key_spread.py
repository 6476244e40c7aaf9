"""The spread of each key block around its mean, and the second-order mass shift it gives the mean correction.

The mean correction weighs a pruned block ``J`` by ``|B_J| exp(s_bar)`` with
``s_bar = q . kbar_J * scale``. The block's true softmax mass is
``sum_i exp(q . k_i * scale)``, which by Jensen's inequality is *at least* that:
the mean correction always understates pruned mass, by ``exp(s_bar)`` times the
mean of ``exp(delta_i)`` over the block's score deviations ``delta_i``. Its
second-order (cumulant) expansion is ``exp(var(delta) / 2)``; with the block's
keys spread evenly over the ``d`` dimensions (variance ``sigma2_J`` per
dimension) ``var(delta) = scale^2 |q|^2 sigma2_J``, so the shift

    ``shift_rJ = min(scale^2 |q_r|^2 sigma2_J / 2, scale |q_r| rho_J)``

added to the logit makes the pooled term estimate the block's mass to second
order. ``rho_J`` is the block's radius (the largest distance of one of its keys
from the mean); the cap keeps the estimate at or below the largest mass the
block can have, ``|B_J| exp(s_bar + scale |q| rho_J)``, so the shifted term
stays between the two bounds that hold for any keys. It costs the kernels no
product: one per-row and two per-column scalars.

Measured on the reference (``benchmarks/NOTES.md``, 2026-12-05) it lowers the
corrected error 2-4x on the planted and drifting test inputs, but gains only 5%
where a few wide key channels dominate the spread: the pooled value then stands
for tokens whose values are far from the mean. A :class:`~fpv2.kernel.CorrectionPlan`
built with ``key_spread=`` asks a kernel for it (the reference and the Triton
kernel apply it; the Hopper kernel refuses such a plan). :class:`KeySpread` is the
kernel wheel's contract, re-exported here.
"""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockStatistics, KeySpread, PagedPrefillBatch
from fpv2.kernel.reference.mass_shift import second_order_shift as _shift
from fpv2.kernel.reference.paged import gather_kv

from .statistics import _check_cache, _check_descale


def compute_key_spread(
    k_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics,
    *,
    k_descale: torch.Tensor | None = None,
) -> KeySpread:
    """The :class:`KeySpread` of every key block of ``batch`` (PyTorch reference, reads through the page table).

    Args:
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        batch: the paged prefill batch.
        statistics: the batch's pooled statistics (their pooled keys are the block means; their
            block size, offsets and lengths give the blocks).
        k_descale: ``(B, Hkv) float32`` key descales, required for FP8 caches.

    Returns:
        The spread, float32, on the statistics' device.

    Raises:
        TypeError, ValueError: a wrong argument, named with its shape and dtype.
    """
    if not isinstance(batch, PagedPrefillBatch):
        raise TypeError(f"batch must be a PagedPrefillBatch, got {type(batch).__name__}")
    if not isinstance(statistics, BlockStatistics):
        raise TypeError(f"statistics must be a BlockStatistics, got {type(statistics).__name__}")
    _check_cache("k_cache", k_cache, batch)
    _check_descale("k_descale", k_descale, k_cache.dtype == torch.float8_e4m3fn, batch, k_cache.shape[2])
    if tuple(k_cache.shape[2:]) != (statistics.num_kv_heads, statistics.head_dim):
        raise ValueError(
            f"k_cache has (Hkv, d) = {tuple(k_cache.shape[2:])}, the statistics "
            f"({statistics.num_kv_heads}, {statistics.head_dim})"
        )
    offsets = statistics.block_offsets.cpu().tolist()
    if len(offsets) != batch.num_requests + 1:
        raise ValueError(f"statistics hold {len(offsets) - 1} requests, the batch {batch.num_requests}")
    block = statistics.block_size
    total, num_kv_heads, head_dim = statistics.pooled_k.shape
    variance = torch.zeros(total, num_kv_heads, dtype=torch.float32, device=statistics.pooled_k.device)
    radius = torch.zeros_like(variance)
    for b, kv_len in enumerate(batch.host.seqlens_k):
        if kv_len == 0:
            continue
        keys = gather_kv(k_cache, batch, b).float()  # (kv_len, Hkv, d)
        if k_descale is not None:
            keys = keys * k_descale[b].float()[None, :, None]
        nblocks = offsets[b + 1] - offsets[b]
        if nblocks * block < kv_len or (nblocks - 1) * block >= kv_len:
            raise ValueError(f"statistics hold {nblocks} blocks for request {b}; its {kv_len} keys need another count")
        means = statistics.pooled_k[offsets[b] : offsets[b + 1]].to(keys.device)  # (nblocks, Hkv, d)
        token_block = torch.arange(kv_len, device=keys.device) // block
        dist2 = (keys - means[token_block]).pow(2).sum(dim=-1)  # (kv_len, Hkv)
        sums = torch.zeros(nblocks, num_kv_heads, device=keys.device).index_add_(0, token_block, dist2)
        counts = statistics.block_lengths[offsets[b] : offsets[b + 1]].to(keys.device).float()[:, None]
        peak = torch.zeros(nblocks, num_kv_heads, device=keys.device)
        peak = peak.scatter_reduce(0, token_block[:, None].expand_as(dist2), dist2, reduce="amax")
        variance[offsets[b] : offsets[b + 1]] = (sums / counts / head_dim).to(variance.device)
        radius[offsets[b] : offsets[b + 1]] = peak.sqrt().to(radius.device)
    return KeySpread(variance=variance, radius=radius)


def second_order_shift(
    rows: torch.Tensor, spread: KeySpread, stat_rows: torch.Tensor, kv_head: int, scale: float
) -> torch.Tensor:
    """The logit shift ``min(scale^2 |q|^2 sigma2 / 2, scale |q| rho)`` of each (row, pooled block) pair.

    Args:
        rows: ``(R, d)`` query rows (in the units of the statistics: FP8 queries with their descale applied).
        spread: the batch's key spread.
        stat_rows: ``(n,)`` statistics rows of the pooled blocks.
        kv_head: the KV head ``h``.
        scale: the softmax scale.

    Returns:
        ``(R, n)`` shifts in natural-log units, in the dtype of ``rows``; add them to the pooled logits
        next to ``log |B_J|`` (:func:`fpv2.kernel.reference.second_order_shift` on the spread's rows).
    """
    return _shift(rows, spread.variance[stat_rows, kv_head], spread.radius[stat_rows, kv_head], scale)
