"""The interface every block-selection strategy implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch

from ..config import SelectionConfig


@runtime_checkable
class SelectionStrategy(Protocol):
    """A way of choosing the kept key blocks of every query tile.

    Every strategy emits the same CSR :class:`~fpv2.kernel.BlockIndex` (segment
    order request, KV head, tile), so strategies are interchangeable in front of
    any kernel. Strategies should be stateless: the registry hands out one
    shared instance.

    Attributes:
        name: the name the strategy is registered under.
    """

    name: str

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
        """Select the kept blocks of every (request, KV head, tile).

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            batch: the paged prefill batch.
            statistics: pooled keys (real units) of every block, pooled with ``config.block_size``.
            config: selection parameters.
            q_descale: ``(B, Hkv) float32`` query descales for FP8 queries.
            k_descale: ``(B, Hkv) float32`` key descales for FP8 caches.

        Returns:
            The block index, built with ``config.tile_size`` and ``config.block_size``.
        """
        ...
