"""The dense strategy: every causally visible block of every tile (a baseline and a fallback)."""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch

from ..config import SelectionConfig
from ..reference.csr import assemble_block_index
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
        shapes = check_selection_inputs(q, batch, statistics, config, q_descale=q_descale, k_descale=k_descale)
        counts, ids = [], []
        host = batch.host
        for q_len, prefix in zip(host.q_lens, host.prefix):
            if q_len == 0:
                continue
            # The per-tile counts come from host lengths: built on the CPU, so their total needs no device sync.
            tiles = request_tiles(
                q_len, prefix, shapes.group, tile_size=config.tile_size, block_size=config.block_size, device="cpu"
            )
            visible = (tiles.last_visible_block + 1).to(torch.int32)
            per_head = _ranges(visible.to(q.device), int(visible.sum()))
            for _ in range(shapes.num_kv_heads):
                counts.append(visible)
                ids.append(per_head)
        # Correct by construction (ascending ranges of visible blocks): the CSR value check would copy every id
        # to the host (at 128K, 16.8M ids: the dense rows' index stage took 180-280 ms on the H200).
        return assemble_block_index(
            counts,
            ids,
            batch,
            group=shapes.group,
            num_kv_heads=shapes.num_kv_heads,
            tile_size=config.tile_size,
            block_size=config.block_size,
            check_values=False,
        )


def _ranges(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``0..n-1`` for each ``n`` of ``lengths`` (summing to ``total``), concatenated, in one vectorised pass."""
    lengths = lengths.long()
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(total, device=lengths.device)
    return (positions - torch.repeat_interleave(starts, lengths, output_size=total)).to(torch.int32)
