"""Argument checks shared by the diagnostics: inputs, index and statistics must describe one batch."""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch, PrefillShapes, validate_prefill_inputs
from fpv2.kernel.reference.attention import check_compute_dtype, resolve_scale

from ..plan import _check_statistics


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    batch: PagedPrefillBatch,
    index: BlockIndex,
    *,
    softmax_scale: float | None,
    compute_dtype: torch.dtype,
    descales: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> tuple[PrefillShapes, float]:
    """Validate the tensors, the block index and the options of one diagnostic call.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        v_cache: paged values, or None for diagnostics that never read them.
        batch: the paged prefill batch.
        index: the block index.
        softmax_scale: explicit scale or None for ``1 / sqrt(d)``.
        compute_dtype: float32 or float64.
        descales: ``(q_descale, k_descale, v_descale)``.

    Returns:
        The shared sizes and the resolved softmax scale.

    Raises:
        TypeError: wrong types or dtypes, naming the argument.
        ValueError: shapes, devices, heads or tiles that do not fit together.
    """
    if not isinstance(batch, PagedPrefillBatch):
        raise TypeError(f"batch must be a PagedPrefillBatch, got {type(batch).__name__}")
    q_descale, k_descale, v_descale = descales
    if v_cache is None:
        # K stands in for V when values are not read; the FP8 rule then wants a V descale too.
        shapes = validate_prefill_inputs(
            q, k_cache, k_cache, batch, q_descale=q_descale, k_descale=k_descale, v_descale=k_descale
        )
    else:
        shapes = validate_prefill_inputs(
            q, k_cache, v_cache, batch, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
        )
    check_compute_dtype(compute_dtype)
    scale = resolve_scale(softmax_scale, shapes.head_dim)
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index must be a BlockIndex, got {type(index).__name__}")
    if index.num_kv_heads != shapes.num_kv_heads:
        raise ValueError(
            f"index has num_kv_heads={index.num_kv_heads}, k_cache has Hkv={shapes.num_kv_heads} "
            f"(shape {tuple(k_cache.shape)})"
        )
    index.check_compatible(batch, shapes.group)
    return shapes, scale


def check_statistics(statistics: BlockStatistics, index: BlockIndex, batch: PagedPrefillBatch, head_dim: int) -> None:
    """The statistics must pool K and V of this batch with the index's block size, heads and head dim.

    Args:
        statistics: pooled keys and values.
        index: the block index.
        batch: the paged prefill batch.
        head_dim: ``d`` of the inputs.

    Raises:
        TypeError: ``statistics`` is not a :class:`~fpv2.kernel.BlockStatistics`.
        ValueError: block size, heads, head dim or blocks per request differ, or no pooled values.
    """
    _check_statistics(statistics, index, batch)
    if statistics.head_dim != head_dim:
        raise ValueError(
            f"statistics have head dim {statistics.head_dim} (pooled_k shape {tuple(statistics.pooled_k.shape)}), "
            f"the inputs have d={head_dim}"
        )
