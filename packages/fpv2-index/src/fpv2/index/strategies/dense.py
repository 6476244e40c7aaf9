"""The dense strategy: every causally visible block of every tile (a baseline and a fallback)."""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch

from ..config import SelectionConfig
from ..reference.csr import leading_blocks_index
from ..reference.inputs import check_selection_inputs
from ..reference.tiles import request_tiles
from .registry import register_strategy


@register_strategy("dense")
class DenseStrategy:
    """Keep blocks ``0 .. last_visible_block`` of every tile: sparse kernels then compute dense attention.

    Attributes:
        name: ``"dense"``.
    """

    name = "dense"

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
        """Keep every visible block.

        Args:
            q: ``(total_q, Hq, d)`` packed queries (only their shape is used).
            batch: the paged prefill batch.
            statistics: pooled keys; only their head count and block layout are used.
            config: selection parameters (``tile_size`` and ``block_size`` matter).
            q_descale: checked like for any strategy, otherwise unused.
            k_descale: checked like for any strategy, otherwise unused.

        Returns:
            The dense block index.
        """
        # No pooled row is read here, so the statistics' offsets cannot change the index: not read back either.
        shapes = check_selection_inputs(
            q, batch, statistics, config, q_descale=q_descale, k_descale=k_descale, read_offsets=False
        )
        host = batch.host
        # Kept blocks per tile from the host lengths (CPU work, no device read), every KV head of a request alike.
        visible: list[torch.Tensor] = []
        for q_len, prefix in zip(host.q_lens, host.prefix):
            if q_len == 0:
                continue
            tiles = request_tiles(
                q_len, prefix, shapes.group, tile_size=config.tile_size, block_size=config.block_size, device="cpu"
            )
            visible += [tiles.last_visible_block + 1] * shapes.num_kv_heads
        counts = torch.cat(visible) if visible else torch.zeros(0, dtype=torch.int64)
        return leading_blocks_index(
            counts,
            batch,
            num_kv_heads=shapes.num_kv_heads,
            group=shapes.group,
            tile_size=config.tile_size,
            block_size=config.block_size,
        )
