"""Every query tile of one (request, KV head) at once, as tensors.

The same arithmetic as :func:`fpv2.kernel.contracts.tile_span`, laid out so the
reference can score and select all tiles of a request with a few tensor ops:
tile ``t`` holds packed rows ``t * Mt .. (t+1) * Mt - 1`` and packed row ``r``
is query position ``r // g`` (PackGQA). Rows past the request's last packed
row are padding and carry position ``-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fpv2.kernel.contracts import num_query_tiles
from fpv2.kernel.reference.packgqa import pack_queries

#: Position given to padding rows and to rows left out of scoring; no block satisfies ``J * Bk <= -1``.
NO_ROW = -1


@dataclass(frozen=True)
class RequestTiles:
    """Absolute KV positions of the packed rows of every tile of one request.

    Attributes:
        row_positions: ``(T, tile_size) int64`` absolute position ``prefix + r // g``
            of each packed row; :data:`NO_ROW` for padding rows of the last tile.
        first_pos: ``(T,) int64`` absolute position of each tile's first row.
        last_pos: ``(T,) int64`` absolute position of each tile's last real row.
        block_size: tokens per key block.
    """

    row_positions: torch.Tensor
    first_pos: torch.Tensor
    last_pos: torch.Tensor
    block_size: int

    @property
    def num_tiles(self) -> int:
        """Number of tiles ``T``."""
        return self.first_pos.numel()

    @property
    def last_visible_block(self) -> torch.Tensor:
        """``(T,)`` highest causally visible block per tile, ``last_pos // Bk``."""
        return self.last_pos // self.block_size

    @property
    def num_scored_blocks(self) -> torch.Tensor:
        """``(T,)`` candidates per tile: blocks fully visible to the last row, ``(last_pos + 1) // Bk``."""
        return (self.last_pos + 1) // self.block_size

    @property
    def first_diagonal_block(self) -> torch.Tensor:
        """``(T,)`` first block of the diagonal band, ``first_pos // Bk``."""
        return self.first_pos // self.block_size

    def probe_positions(self, stride: int) -> torch.Tensor:
        """Row positions with every row but each ``stride``-th one (from the tile's first) masked out.

        Args:
            stride: keep rows ``0, stride, 2 * stride, ...`` of every tile.

        Returns:
            ``(T, tile_size) int64`` positions, :data:`NO_ROW` for rows not probed.
        """
        if stride == 1:
            return self.row_positions
        keep = torch.arange(self.row_positions.shape[1], device=self.row_positions.device) % stride == 0
        return torch.where(keep[None, :], self.row_positions, torch.full_like(self.row_positions, NO_ROW))


def request_tiles(
    q_len: int,
    prefix: int,
    group: int,
    *,
    tile_size: int,
    block_size: int,
    device: torch.device | str = "cpu",
) -> RequestTiles:
    """Tile geometry of a request with ``q_len`` queries over a cached prefix of ``prefix`` tokens.

    Args:
        q_len: new queries of the request (may be 0: no tiles).
        prefix: cached KV tokens before the first query.
        group: GQA group size ``g``.
        tile_size: packed rows per tile.
        block_size: tokens per key block.
        device: where to build the tensors.

    Returns:
        The :class:`RequestTiles` of the request.
    """
    num_tiles = num_query_tiles(q_len, group, tile_size)
    rows = torch.arange(num_tiles * tile_size, device=device, dtype=torch.int64)
    real = rows < q_len * group
    positions = torch.where(real, prefix + rows // group, torch.full_like(rows, NO_ROW))
    positions = positions.view(num_tiles, tile_size)
    tile_rows = torch.arange(num_tiles, device=device, dtype=torch.int64) * tile_size
    last_rows = torch.clamp(tile_rows + tile_size, max=q_len * group) - 1
    return RequestTiles(positions, prefix + tile_rows // group, prefix + last_rows // group, block_size)


def tile_rows(q: torch.Tensor, group: int, kv_head: int, tile_size: int) -> torch.Tensor:
    """The request's packed query rows of ``kv_head``, as fp32 tiles padded with zeros.

    Args:
        q: ``(q_len, Hq, d)`` queries of one request (any activation dtype).
        group: GQA group size ``g``.
        kv_head: KV head whose ``g`` query heads are packed.
        tile_size: packed rows per tile.

    Returns:
        ``(T, tile_size, d) float32``.
    """
    packed = pack_queries(q, group, kv_head).float()
    num_tiles = num_query_tiles(q.shape[0], group, tile_size)
    out = torch.zeros(num_tiles * tile_size, q.shape[2], dtype=torch.float32, device=q.device)
    out[: packed.shape[0]] = packed
    return out.view(num_tiles, tile_size, q.shape[2])
