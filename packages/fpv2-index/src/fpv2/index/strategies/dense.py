"""The dense strategy: every causally visible block of every tile (a baseline and a fallback)."""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch
from fpv2.kernel.contracts.block_index import expected_tile_offsets

from ..config import SelectionConfig
from ..reference.inputs import check_selection_inputs
from ..reference.tiles import request_tiles
from ..transfer import device_ints
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
        offsets_host = torch.zeros(counts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, dim=0, out=offsets_host[1:])
        total = int(offsets_host[-1])
        # One non-blocking copy of the offsets (a pageable copy would make the host wait for the stream), the ids
        # expanded on the device: 16.8M ids at 128K built and copied on the host cost 8 ms and a sync a call.
        offsets = device_ints(offsets_host, batch.device)
        blocks = _ranges(offsets, total)
        tile_offsets = device_ints(expected_tile_offsets(batch, shapes.group, config.tile_size), batch.device)
        # Correct by construction (ascending ranges of visible blocks): the CSR value check would copy every id
        # to the host.
        return BlockIndex(
            offsets,
            blocks,
            tile_offsets,
            shapes.num_kv_heads,
            shapes.group,
            config.tile_size,
            config.block_size,
            check_values=False,
        )


def _ranges(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Ids ``0 .. n_s - 1`` of every segment ``s`` of the CSR ``offsets`` (``total`` ids in all), on their device."""
    starts = offsets[:-1].long()
    counts = offsets[1:].long() - starts
    segment_start = torch.repeat_interleave(starts, counts, output_size=total)
    return (torch.arange(total, device=offsets.device) - segment_start).to(torch.int32)
