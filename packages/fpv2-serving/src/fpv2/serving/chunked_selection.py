"""Chunk-aware block selection: the unchunked selection, restricted to a chunk.

Selecting a chunk naively (the index run on the chunk batch as if it were a
whole prefill) differs from the unchunked selection in its dense fallbacks
only: the last ``dense_tail_tiles`` tiles of *every chunk* keep every visible
block, and a chunk whose KV is below ``min_sparse_kv_len`` keeps everything,
which raises the density of chunked runs. Here the fallbacks are decided on
the whole prompt (:meth:`~.chunked_state.ChunkedPrefillState.dense_tile_count`),
by composition with any selection strategy: the strategy runs with the chunk's
``min_sparse_kv_len`` switched off and, when one ``dense_tail_tiles`` value
gives every request of the chunk its whole-prompt dense tail (the usual case,
:func:`uniform_dense_tail`), with that value, so the selection kernel itself
keeps those tiles dense; otherwise with both fallbacks off, and the tiles that
are dense by the whole-prompt rule are overwritten with all their visible
blocks afterwards (:func:`densify_segments`). No step reads the device on the
host.

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
import functools
from collections.abc import Sequence

import torch

from fpv2.index import SelectionConfig, SelectionStrategy
from fpv2.index.api import _build_block_index
from fpv2.index.reference import leading_blocks_index
from fpv2.kernel.contracts import (
    BlockIndex,
    BlockStatistics,
    PagedPrefillBatch,
    num_query_tiles,
)

from .chunked_state import ChunkedPrefillState, suffix_mask
from .transfer import device_ints

#: The strategy name that keeps every visible block.
DENSE_STRATEGY = "dense"


def chunk_dense_tile_counts(
    states: Sequence[ChunkedPrefillState], batch: PagedPrefillBatch, group: int, config: SelectionConfig
) -> list[int]:
    """How many last tiles of every request of a chunk batch are dense, by each state's whole-prompt rule.

    Args:
        states: one state per request, in batch order.
        batch: the chunk batch.
        group: GQA group size ``g``.
        config: selection parameters.

    Returns:
        One count per request (:meth:`ChunkedPrefillState.dense_tile_count`).

    Raises:
        ValueError: wrong number of states, or a chunk outside its state's prefill.
    """
    if len(states) != batch.num_requests:
        raise ValueError(
            f"states must hold one ChunkedPrefillState per request ({batch.num_requests}); got {len(states)}"
        )
    host = batch.host
    return [s.dense_tile_count(p, n, group, config) for s, p, n in zip(states, host.prefix, host.q_lens)]


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


def dense_suffix_length(mask: torch.Tensor) -> int | None:
    """Length of the dense suffix a ``(T,) bool`` dense-tile mask describes, or None if it is no suffix.

    Args:
        mask: dense tiles of one request.

    Returns:
        ``n`` when exactly the last ``n`` tiles are dense, else None.
    """
    n = int(mask.sum())
    tiles = mask.numel()
    suffix = torch.arange(tiles) >= tiles - n
    return n if torch.equal(mask.to(torch.bool), suffix) else None


def uniform_dense_tail(dense_tiles: Sequence[torch.Tensor]) -> int | None:
    """One ``dense_tail_tiles`` value whose per-request rule reproduces ``dense_tiles``, if there is one.

    The index's own fallback keeps the last ``dense_tail_tiles`` tiles of every request
    dense, decided in the selection kernel. The whole-prompt rule gives each request of a
    chunk a dense suffix (none in a middle chunk, the prompt's tail in its last chunk, all
    tiles for a short prompt); when one value ``n`` gives every request
    ``min(n, tiles_b)`` dense tiles, the strategy applies the rule itself and no second
    pass over the index is needed.

    Args:
        dense_tiles: one ``(T_b,) bool`` mask per request.

    Returns:
        ``n``, or None when the requests need different tails (or a mask is no suffix).
    """
    suffixes = []
    for mask in dense_tiles:
        n = dense_suffix_length(mask)
        if n is None:
            return None
        suffixes.append(n)
    return uniform_tail_of_counts(suffixes, [mask.numel() for mask in dense_tiles])


def uniform_tail_of_counts(counts: Sequence[int], tiles: Sequence[int]) -> int | None:
    """:func:`uniform_dense_tail` for dense suffixes given by their lengths.

    Args:
        counts: dense last tiles per request.
        tiles: tiles per request.

    Returns:
        ``n`` with ``min(n, tiles[b]) == counts[b]`` for every request, or None.
    """
    partial = {n for n, t in zip(counts, tiles) if n < t}
    if len(partial) > 1:
        return None
    tail = partial.pop() if partial else max(tiles, default=0)
    return tail if all(min(tail, t) == n for n, t in zip(counts, tiles)) else None


@functools.lru_cache(maxsize=64)
def _chunk_config(config: SelectionConfig, tail: int) -> SelectionConfig:
    """The selection parameters a chunk's strategy sees: the whole-prompt tail (or none), no short-prompt rule.

    Cached: building a SelectionConfig validates every field, and a chunk needs one of very few.
    """
    return dataclasses.replace(config, dense_tail_tiles=tail, min_sparse_kv_len=0)


def dense_block_index(
    batch: PagedPrefillBatch,
    *,
    num_kv_heads: int,
    group: int,
    tile_size: int,
    block_size: int,
) -> BlockIndex:
    """The block index keeping every visible block of every tile, built without a host sync.

    The geometry is known on the host (``batch.host``), so the offsets and the size are
    computed there and copied once without blocking; the block ids are ranges expanded on
    the device.

    Args:
        batch: the chunk batch.
        num_kv_heads: ``Hkv``.
        group: GQA group size ``g``.
        tile_size: packed rows per tile.
        block_size: tokens per key block.

    Returns:
        The dense :class:`BlockIndex` (exact size, no spare capacity).
    """
    masks = [torch.ones(num_query_tiles(n, group, tile_size), dtype=torch.bool) for n in batch.host.q_lens]
    _, visible = _segment_geometry(batch, masks, num_kv_heads, group, tile_size, block_size)
    return leading_blocks_index(
        visible, batch, num_kv_heads=num_kv_heads, group=group, tile_size=tile_size, block_size=block_size
    )


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
    """Replace the kept lists of the dense tiles by every visible block, without a host sync.

    The new ``blocks`` array is sized for every visible (tile, block) pair (known on the
    host): its first ``offsets[-1]`` entries are the index, the rest hold -1 (spare
    capacity, which the block index contract allows), so the new size is never read back.

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
    geometry = {"num_kv_heads": num_kv_heads, "group": group, "tile_size": tile_size, "block_size": block_size}
    dense_host, visible_host = _segment_geometry(batch, dense_tiles, num_kv_heads, group, tile_size, block_size)
    num_segments = dense_host.numel()
    if index is None:
        if not bool(dense_host.all()):
            raise ValueError("densify_segments needs an index unless every tile is dense")
        return dense_block_index(batch, **geometry)
    if index.num_segments != num_segments:
        raise ValueError(f"index has {index.num_segments} segments, the batch has {num_segments}")
    device = batch.device
    dense = device_ints(dense_host, device) != 0
    visible = device_ints(visible_host, device, dtype=torch.int64)
    old_offsets, old_blocks = index.offsets.long(), index.blocks
    counts = torch.where(dense, visible, old_offsets[1:] - old_offsets[:-1])
    offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    # Every segment keeps at most its visible blocks: their sum bounds the new size on the host.
    capacity = int(visible_host.sum())
    position = torch.arange(capacity, device=device)
    # Segment of each position (positions past the new size land on the last segment, masked below).
    segment = torch.searchsorted(offsets[1:], position, right=True).clamp(max=max(num_segments - 1, 0))
    local = position - offsets[:-1][segment]
    if old_blocks.numel():
        # Positions inside a dense segment may point past the old list: clamp, they are replaced anyway.
        source = (old_offsets[:-1][segment] + local).clamp(min=0, max=old_blocks.numel() - 1)
        kept = old_blocks[source].long()
    else:
        kept = torch.zeros_like(local)
    blocks = torch.where(dense[segment], local, kept)
    blocks = torch.where(position < offsets[-1], blocks, -1).to(torch.int32)
    return BlockIndex(
        offsets.to(torch.int32),
        blocks,
        index.tile_offsets,
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
    inputs_validated: bool = False,
) -> tuple[BlockIndex, int]:
    """Block index of a chunk batch with the dense fallbacks decided on each request's whole prompt.

    Three ways, none with a host sync of its own: every tile dense (a short prompt, or the
    ``dense`` strategy) builds the dense index from host geometry; a dense tail the
    index's own ``dense_tail_tiles`` rule can express for every request (the usual case:
    none in a middle chunk, the prompt's tail in the last one) is handed to the strategy
    in its config; otherwise the strategy selects with both fallbacks off and
    :func:`densify_segments` overwrites the dense tiles.

    Args:
        q: ``(total_q, Hq, d)`` queries of the chunk batch.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        batch: the chunk batch.
        statistics: pooled keys of every block of the chunk batch (from the states);
            may be None only when every tile is dense or ``strategy`` is ``"dense"``.
        states: one :class:`ChunkedPrefillState` per request, in batch order.
        config: selection parameters, with the fallbacks meant for the whole prompt.
        strategy: a strategy name or instance (it sees ``config`` with the fallbacks of the chunk).
        q_descale: ``(B, Hkv) float32`` FP8 query descales.
        k_descale: ``(B, Hkv) float32`` FP8 key descales.
        inputs_validated: the caller has just run
            :func:`~fpv2.kernel.contracts.validate_prefill_inputs` on these inputs (with its V
            cache): the index skips its own check of them.

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
    tiles = [num_query_tiles(n, group, config.tile_size) for n in batch.host.q_lens]
    counts = chunk_dense_tile_counts(states, batch, group, config)
    if strategy == DENSE_STRATEGY or getattr(strategy, "name", None) == DENSE_STRATEGY:
        counts = tiles
    num_dense = sum(counts)
    geometry = {"num_kv_heads": num_kv_heads, "group": group, "tile_size": config.tile_size}
    if num_dense == sum(tiles):
        return dense_block_index(batch, block_size=config.block_size, **geometry), num_dense
    if statistics is None:
        raise ValueError("statistics are required when some tile of the chunk is selected sparsely")
    tail = uniform_tail_of_counts(counts, tiles)
    # The chunk's own fallbacks: the whole-prompt tail when the index rule can state it, else none.
    index = _build_block_index(
        q,
        k_cache,
        batch,
        config=_chunk_config(config, tail or 0),
        strategy=strategy,
        statistics=statistics,
        q_descale=q_descale,
        k_descale=k_descale,
        inputs_validated=inputs_validated,
    )
    if num_dense and tail is None:
        masks = [suffix_mask(t, c) for t, c in zip(tiles, counts)]
        index = densify_segments(index, batch, masks, block_size=config.block_size, **geometry)
    return index, num_dense
