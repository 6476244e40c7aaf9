"""Blocks a tile keeps whatever its scores say, and tiles that keep everything.

Forced blocks of a tile whose first and last absolute query positions are
``a = prefix + p_first`` and ``z = prefix + p_last`` (ALGORITHM.md section 3):

- sink: ``J * Bk < sink_tokens``;
- window: blocks overlapping the ``window_tokens`` tokens before the tile,
  i.e. tokens ``max(0, a - window_tokens) .. a - 1`` (none when the window is 0
  or ``a == 0``);
- diagonal band: every block from ``a // Bk`` to ``z // Bk``, kept even when the
  window is 0 (the published code drops it there);

all under the causal limit ``J <= z // Bk``. Dense fallbacks: the last
``dense_tail_tiles`` tiles of every request, and every tile of a request with
``seqlens_k < min_sparse_kv_len``, keep all visible blocks.

:func:`forced_blocks` states the rule for one tile in plain Python;
:func:`forced_block_mask` is the same rule on all tiles of a request at once.
"""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import TileSpan, cdiv

from ..config import SelectionConfig
from .tiles import RequestTiles


def forced_blocks(span: TileSpan, config: SelectionConfig) -> list[int]:
    """Ascending forced block ids (sink, window, diagonal band) of one tile.

    Args:
        span: the tile (its ``block_size`` must equal ``config.block_size``).
        config: selection parameters.

    Returns:
        Sorted block ids, all ``<= span.last_visible_block``.

    Raises:
        ValueError: ``span.block_size`` differs from ``config.block_size``.
    """
    if span.block_size != config.block_size:
        raise ValueError(f"span.block_size={span.block_size} differs from config.block_size={config.block_size}")
    bk = config.block_size
    first = span.prefix + span.p_first
    limit = span.last_visible_block
    forced = set(range(min(cdiv(config.sink_tokens, bk), limit + 1)))
    if config.window_tokens > 0 and first > 0:
        forced.update(range(max(0, first - config.window_tokens) // bk, (first - 1) // bk + 1))
    forced.update(range(span.first_diagonal_block, limit + 1))
    return sorted(j for j in forced if j <= limit)


def dense_tile_count(num_tiles: int, kv_len: int, config: SelectionConfig) -> int:
    """How many last tiles of a request keep every visible block (the dense fallbacks, as a count).

    The dense tiles are always a request's last ones: its last ``dense_tail_tiles`` tiles, or all of
    them for a request shorter than ``min_sparse_kv_len``. Plain integers, for host code that runs per
    call (:func:`is_dense_tile` and :func:`dense_tile_mask` state the same rule per tile).

    Args:
        num_tiles: tiles of the request (per KV head).
        kv_len: ``seqlens_k`` of the request, prefix included.
        config: selection parameters.

    Returns:
        ``n`` in ``[0, num_tiles]``: tiles ``num_tiles - n ..`` are dense.
    """
    if kv_len < config.min_sparse_kv_len:
        return num_tiles
    return min(config.dense_tail_tiles, num_tiles)


def is_dense_tile(tile: int, num_tiles: int, kv_len: int, config: SelectionConfig) -> bool:
    """Whether tile ``tile`` of a request keeps every visible block (dense fallback).

    Args:
        tile: tile index within the request (per KV head).
        num_tiles: tiles of the request.
        kv_len: ``seqlens_k`` of the request, prefix included.
        config: selection parameters.

    Returns:
        True for the last ``dense_tail_tiles`` tiles and for requests shorter than ``min_sparse_kv_len``.
    """
    return tile >= num_tiles - dense_tile_count(num_tiles, kv_len, config)


def visible_block_mask(tiles: RequestTiles, num_blocks: int) -> torch.Tensor:
    """``(T, num_blocks) bool``: block ``J`` is causally visible to tile ``t`` (``J <= last_pos // Bk``).

    Args:
        tiles: the request's tiles.
        num_blocks: key blocks of the request.

    Returns:
        The visibility mask.
    """
    ids = torch.arange(num_blocks, device=tiles.last_pos.device)
    return ids[None, :] <= tiles.last_visible_block[:, None]


def forced_block_mask(tiles: RequestTiles, num_blocks: int, config: SelectionConfig) -> torch.Tensor:
    """``(T, num_blocks) bool`` forced blocks of every tile of a request (same rule as :func:`forced_blocks`).

    Args:
        tiles: the request's tiles (built with ``config.block_size``).
        num_blocks: key blocks of the request.
        config: selection parameters.

    Returns:
        Sink, window and diagonal-band blocks, restricted to the visible ones.
    """
    bk = tiles.block_size
    ids = torch.arange(num_blocks, device=tiles.first_pos.device)[None, :]
    first = tiles.first_pos[:, None]
    sink = ids < cdiv(config.sink_tokens, bk)
    if config.window_tokens > 0:
        window_lo = torch.clamp(first - config.window_tokens, min=0) // bk
        window = (ids >= window_lo) & (ids <= (first - 1) // bk) & (first > 0)
    else:
        window = torch.zeros_like(sink)
    diagonal = ids >= tiles.first_diagonal_block[:, None]
    return (sink | window | diagonal) & visible_block_mask(tiles, num_blocks)


def dense_tile_mask(num_tiles: int, kv_len: int, config: SelectionConfig, device: torch.device | str) -> torch.Tensor:
    """``(T,) bool`` tiles of a request that fall back to dense (same rule as :func:`is_dense_tile`).

    Args:
        num_tiles: tiles of the request.
        kv_len: ``seqlens_k`` of the request.
        config: selection parameters.
        device: where to build the mask.

    Returns:
        The dense-tile mask.
    """
    return torch.arange(num_tiles, device=device) >= num_tiles - dense_tile_count(num_tiles, kv_len, config)
