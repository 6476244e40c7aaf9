"""Chunk-aware block selection: the unchunked selection, restricted to a chunk.

Selecting a chunk naively (the index run on the chunk batch as if it were a
whole prefill) differs from the unchunked selection in its dense fallbacks
only: the last ``dense_tail_tiles`` tiles of *every chunk* keep every visible
block, and a chunk whose KV is below ``min_sparse_kv_len`` keeps everything,
which raises the density of chunked runs. Here the fallbacks are decided on
the whole prompt (:meth:`~.chunked_state.ChunkedPrefillState.dense_tile_mask`),
by composition with any selection strategy: the strategy runs with both
fallbacks switched off, then the tiles that are dense by the whole-prompt rule
are overwritten with all their visible blocks (:func:`densify_segments`).

Exactness. The max-threshold selection of a tile depends on its packed rows,
their absolute positions, the pooled keys of the blocks fully visible to its
last row (complete blocks, pooled identically whether the prefix arrived in
chunks or not: see :mod:`.chunked_pooling`), and the dense fallbacks. So when
every chunk starts on a tile boundary of the whole prefill, i.e.
``(chunk_start - prefill_start) * g % tile_size == 0`` (for equal chunks:
``chunk_len * g % tile_size == 0``), the chunk's tiles *are* tiles of the
unchunked call and its selection equals the unchunked selection restricted to
them, exactly, whatever the block alignment of the chunk boundaries.

Otherwise the tiles differ: the last tile of a chunk is partial and the next
chunk's tiles are shifted, so (1) the per-tile maximum and the ``alpha``
threshold are taken over a different set of rows, (2) a chunk boundary adds
about one tile per KV head, each with its own forced diagonal band and window,
which raises the density slightly, (3) a chunk tile straddling the start of
the prompt's dense tail is dense as a whole (a few extra dense rows), and (4)
the correction's eligible range, which depends on the tile's first row,
shifts accordingly. The output of every row is still exact attention over its
kept blocks plus the correction; only which blocks are kept differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from fpv2.index import SelectionConfig, SelectionStrategy, build_block_index
from fpv2.kernel.contracts import (
    BlockIndex,
    BlockStatistics,
    PagedPrefillBatch,
    expected_tile_offsets,
    num_query_tiles,
)

from .chunked_state import ChunkedPrefillState

#: The strategy name that keeps every visible block.
DENSE_STRATEGY = "dense"


def chunk_dense_tiles(
    states: Sequence[ChunkedPrefillState], batch: PagedPrefillBatch, group: int, config: SelectionConfig
) -> list[torch.Tensor]:
    """Dense tiles of every request of a chunk batch, by each state's whole-prompt rule.

    Args:
        states: one state per request, in batch order.
        batch: the chunk batch.
        group: GQA group size ``g``.
        config: selection parameters.

    Returns:
        One ``(T_b,) bool`` CPU mask per request.

    Raises:
        ValueError: wrong number of states, or a chunk outside its state's prefill.
    """
    if len(states) != batch.num_requests:
        raise ValueError(
            f"states must hold one ChunkedPrefillState per request ({batch.num_requests}); got {len(states)}"
        )
    host = batch.host
    return [s.dense_tile_mask(p, n, group, config) for s, p, n in zip(states, host.prefix, host.q_lens)]


def _segment_geometry(
    batch: PagedPrefillBatch,
    dense_tiles: Sequence[torch.Tensor],
    num_kv_heads: int,
    group: int,
    tile_size: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment (request, KV head, tile order): dense flag and number of visible blocks (host tensors)."""
    dense_parts, visible_parts = [], []
    for mask, q_len, prefix in zip(dense_tiles, batch.host.q_lens, batch.host.prefix):
        num_tiles = num_query_tiles(q_len, group, tile_size)
        if mask.numel() != num_tiles:
            raise ValueError(f"dense tile mask has {mask.numel()} entries, the request has {num_tiles} tiles")
        if num_tiles == 0:
            continue
        tiles = torch.arange(num_tiles, dtype=torch.int64)
        last_pos = prefix + (torch.clamp((tiles + 1) * tile_size, max=q_len * group) - 1) // group
        visible = last_pos // block_size + 1
        dense_parts.append(mask.to(torch.bool).repeat(num_kv_heads))
        visible_parts.append(visible.repeat(num_kv_heads))
    if not dense_parts:
        return torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.int64)
    return torch.cat(dense_parts), torch.cat(visible_parts)


def densify_segments(
    index: BlockIndex | None,
    batch: PagedPrefillBatch,
    dense_tiles: Sequence[torch.Tensor],
    *,
    num_kv_heads: int,
    group: int,
    tile_size: int,
    block_size: int,
) -> BlockIndex:
    """Replace the kept lists of the dense tiles by every visible block (vectorised, one host read of nnz).

    Args:
        index: the selection of the chunk batch, or None when every tile is dense.
        batch: the chunk batch.
        dense_tiles: one ``(T_b,) bool`` mask per request (same for every KV head).
        num_kv_heads: ``Hkv``.
        group: GQA group size ``g``.
        tile_size: packed rows per tile.
        block_size: tokens per key block.

    Returns:
        A :class:`BlockIndex` equal to ``index`` on the other tiles.

    Raises:
        ValueError: ``index`` is None but some tile is not dense, or ``index`` does
            not have the batch's segments.
    """
    if len(dense_tiles) != batch.num_requests:
        raise ValueError(f"dense_tiles must hold one mask per request ({batch.num_requests}); got {len(dense_tiles)}")
    device = batch.device
    dense_host, visible_host = _segment_geometry(batch, dense_tiles, num_kv_heads, group, tile_size, block_size)
    num_segments = dense_host.numel()
    if index is None and not bool(dense_host.all()):
        raise ValueError("densify_segments needs an index unless every tile is dense")
    if index is not None and index.num_segments != num_segments:
        raise ValueError(f"index has {index.num_segments} segments, the batch has {num_segments}")
    dense = dense_host.to(device)
    visible = visible_host.to(device)
    if index is None:
        old_offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=device)
        old_blocks = torch.zeros(0, dtype=torch.int32, device=device)
    else:
        old_offsets, old_blocks = index.offsets.long(), index.blocks
    counts = torch.where(dense, visible, old_offsets[1:] - old_offsets[:-1])
    offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    nnz = int(offsets[-1])  # the one host read: the size of the new blocks array
    segment = torch.repeat_interleave(torch.arange(num_segments, device=device), counts, output_size=nnz)
    local = torch.arange(nnz, device=device) - offsets[:-1][segment]
    if old_blocks.numel():
        # Positions inside a dense segment may point past the old list: clamp, they are replaced anyway.
        source = (old_offsets[:-1][segment] + local).clamp(max=old_blocks.numel() - 1)
        kept = old_blocks[source].long()
    else:
        kept = torch.zeros_like(local)
    blocks = torch.where(dense[segment], local, kept).to(torch.int32).contiguous()
    tile_offsets = (
        index.tile_offsets if index is not None else expected_tile_offsets(batch, group, tile_size).to(device)
    )
    return BlockIndex(
        offsets.to(torch.int32),
        blocks,
        tile_offsets,
        num_kv_heads,
        group,
        tile_size,
        block_size,
        check_values=False,
    )


def select_chunk_blocks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics | None,
    states: Sequence[ChunkedPrefillState],
    *,
    config: SelectionConfig,
    strategy: str | SelectionStrategy = "max_threshold",
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
) -> tuple[BlockIndex, int]:
    """Block index of a chunk batch with the dense fallbacks decided on each request's whole prompt.

    Args:
        q: ``(total_q, Hq, d)`` queries of the chunk batch.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        batch: the chunk batch.
        statistics: pooled keys of every block of the chunk batch (from the states);
            may be None only when every tile is dense or ``strategy`` is ``"dense"``.
        states: one :class:`ChunkedPrefillState` per request, in batch order.
        config: selection parameters, with the fallbacks meant for the whole prompt.
        strategy: a strategy name or instance (it sees ``config`` with both fallbacks off).
        q_descale: ``(B, Hkv) float32`` FP8 query descales.
        k_descale: ``(B, Hkv) float32`` FP8 key descales.

    Returns:
        ``(index, dense_tiles)``: the block index and the number of tiles (per KV
        head) kept dense by the whole-prompt rule.

    Raises:
        TypeError, ValueError: bad inputs, naming the argument.
    """
    if not isinstance(config, SelectionConfig):
        raise TypeError(f"config must be a fpv2.index.SelectionConfig; got {type(config).__name__}")
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    dense_tiles = chunk_dense_tiles(states, batch, group, config)
    if strategy == DENSE_STRATEGY or getattr(strategy, "name", None) == DENSE_STRATEGY:
        dense_tiles = [torch.ones_like(m) for m in dense_tiles]
    num_dense = int(sum(int(m.sum()) for m in dense_tiles))
    num_tiles = sum(m.numel() for m in dense_tiles)
    geometry = {"num_kv_heads": num_kv_heads, "group": group, "tile_size": config.tile_size}
    if num_dense == num_tiles:
        return densify_segments(None, batch, dense_tiles, block_size=config.block_size, **geometry), num_dense
    if statistics is None:
        raise ValueError("statistics are required when some tile of the chunk is selected sparsely")
    # The strategy selects as if no tile were dense; the whole-prompt fallbacks are applied afterwards.
    inner = dataclasses.replace(config, dense_tail_tiles=0, min_sparse_kv_len=0)
    index = build_block_index(
        q,
        k_cache,
        batch,
        config=inner,
        strategy=strategy,
        statistics=statistics,
        q_descale=q_descale,
        k_descale=k_descale,
    )
    if num_dense:
        index = densify_segments(index, batch, dense_tiles, block_size=config.block_size, **geometry)
    return index, num_dense
