"""PackGQA tile and key-block geometry: the arithmetic every stage must agree on.

For one KV head the ``g`` query heads are packed row-major by position: packed
row ``r`` is query position ``r // g`` of query head ``kv_head * g + r % g``.
A query tile is ``tile_size`` consecutive packed rows. Key block ``J`` holds
absolute KV positions ``[J * block_size, (J + 1) * block_size)``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Packed query rows per tile; the index and the attention kernel must agree.
TILE_SIZE = 128
#: Tokens per key block (the selection unit).
BLOCK_SIZE = 128


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def num_query_tiles(q_len: int, group: int, tile_size: int = TILE_SIZE) -> int:
    """Tiles covering the ``q_len * group`` packed rows of one (request, KV head)."""
    return cdiv(q_len * group, tile_size)


def num_key_blocks(kv_len: int, block_size: int = BLOCK_SIZE) -> int:
    """Key blocks covering ``kv_len`` tokens (the last may be partial)."""
    return cdiv(kv_len, block_size)


@dataclass(frozen=True)
class TileSpan:
    """Packed rows and query positions of one tile of one request.

    Positions are relative to the request's first new query; add ``prefix`` for
    absolute KV positions.
    """

    row_begin: int  # first packed row
    row_end: int  # one past the last packed row
    p_first: int  # query position of the first row
    p_last: int  # query position of the last row
    prefix: int  # cached prefix of the request
    block_size: int

    @property
    def last_visible_block(self) -> int:
        """Highest block any row of the tile may see (``(prefix + p_last) // Bk``)."""
        return (self.prefix + self.p_last) // self.block_size

    @property
    def num_visible_blocks(self) -> int:
        """Blocks causally visible to the tile: ``0 .. last_visible_block``."""
        return self.last_visible_block + 1

    @property
    def num_scored_blocks(self) -> int:
        """Candidates for scoring: blocks fully visible to the last row."""
        return (self.prefix + self.p_last + 1) // self.block_size

    @property
    def num_correctable_blocks(self) -> int:
        """Blocks eligible for the mean correction: ``J < (prefix + p_first) // Bk``."""
        return (self.prefix + self.p_first) // self.block_size

    @property
    def first_diagonal_block(self) -> int:
        """First block of the diagonal band (block of the tile's first query)."""
        return (self.prefix + self.p_first) // self.block_size


def tile_span(
    tile: int, q_len: int, prefix: int, group: int, *, tile_size: int = TILE_SIZE, block_size: int = BLOCK_SIZE
) -> TileSpan:
    """Rows and positions of tile ``tile`` of a request with ``q_len`` queries."""
    rows = q_len * group
    row_begin = tile * tile_size
    if not 0 <= row_begin < rows:
        raise ValueError(f"tile {tile} is outside the {num_query_tiles(q_len, group, tile_size)} tiles of this request")
    row_end = min(row_begin + tile_size, rows)
    return TileSpan(row_begin, row_end, row_begin // group, (row_end - 1) // group, prefix, block_size)
