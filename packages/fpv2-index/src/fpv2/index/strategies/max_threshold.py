"""The paper's selector: keep blocks whose energy reaches ``alpha`` times the tile's largest."""

from __future__ import annotations

import os

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch

from ..config import SelectionConfig
from ..reference.selection import select_blocks
from .registry import register_strategy


@register_strategy("max_threshold")
class MaxThresholdStrategy:
    """Max-threshold selection with forced sink, window and diagonal blocks (ALGORITHM.md section 3).

    The default strategy. On CUDA inputs it runs the fused Triton kernel
    (:func:`fpv2.index.triton.select_blocks_triton`); elsewhere, or when the
    environment sets ``FPV2_INDEX_IMPL=reference``, the PyTorch reference
    (:func:`fpv2.index.reference.select_blocks`). Both produce the same index
    up to near-threshold rounding.

    Attributes:
        name: ``"max_threshold"``.
    """

    name = "max_threshold"

    def select(
        self,
        q: torch.Tensor,
        batch: PagedPrefillBatch,
        statistics: BlockStatistics,
        *,
        config: SelectionConfig,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
    ) -> BlockIndex:
        """Select blocks by the max-threshold rule.

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            batch: the paged prefill batch.
            statistics: pooled keys (real units), pooled with ``config.block_size``.
            config: selection parameters.
            q_descale: ``(B, Hkv) float32`` query descales for FP8 queries.
            k_descale: ``(B, Hkv) float32`` key descales; checked only, since the
                statistics are already dequantised.

        Returns:
            The block index.
        """
        if use_triton_index(q):
            from ..triton import select_blocks_triton  # imports triton: only on the fast path

            return select_blocks_triton(q, batch, statistics, config=config, q_descale=q_descale, k_descale=k_descale)
        return select_blocks(q, batch, statistics, config=config, q_descale=q_descale, k_descale=k_descale)


def use_triton_index(q: torch.Tensor) -> bool:
    """Whether the fused Triton index runs for ``q``: CUDA inputs, unless ``FPV2_INDEX_IMPL=reference``.

    Args:
        q: the packed queries.

    Returns:
        True for the Triton fast path.
    """
    return q.is_cuda and os.environ.get("FPV2_INDEX_IMPL", "auto") != "reference"
