"""Exact attention weights of a block index's tiles, a chunk of whole tiles at a time.

Every diagnostic needs the same thing: for each packed row of a tile, the
unnormalised softmax weights ``w_ri = exp(s_ri - m_r)`` over every causally
visible key (``m_r`` is the row's maximum logit), laid out by key block, next
to the tile's kept and correction-eligible blocks. :func:`walk_tile_chunks`
yields them per (request, KV head), for as many whole tiles as fit a bounded
``rows x keys`` logit matrix, so memory stays bounded at long context and the
work is vectorised over rows and keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fpv2.kernel.contracts import BlockIndex, PagedPrefillBatch, PrefillShapes, num_key_blocks
from fpv2.kernel.reference.attention import request_operands
from fpv2.kernel.reference.packgqa import pack_queries, packed_rows_to_position_head

#: Upper bound on ``rows x keys`` entries of one chunk's logit matrix (the walker
#: holds a few arrays of this size): 2**23 fp32 entries are 32 MiB.
CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True, eq=False)
class TileChunk:
    """Exact attention weights of ``T`` consecutive tiles of one (request, KV head).

    Rows are the tiles' PackGQA rows in order; key blocks are ``0 .. nb - 1``
    where ``nb`` covers every key visible to the chunk's last row.

    Attributes:
        request: request ``b``.
        kv_head: KV head ``h``.
        segments: ``(T,) long`` segment ids of the tiles in the block index's order.
        row_tile: ``(R,) long`` tile of each row, ``0 .. T-1``.
        out_rows: ``(R,) long`` row of the packed ``(total_q, Hq, d)`` tensors.
        out_heads: ``(R,) long`` query head of each row.
        queries: ``(R, d)`` query rows in the compute dtype and real units.
        weights: ``(R, nb, Bk)`` ``exp(s - m_r)``, exactly 0 on keys the row cannot see
            (causally later, or past the request's KV length).
        row_max: ``(R,)`` the row maximum ``m_r`` of the scaled logits.
        values: ``(nb, Bk, d)`` value tokens, zero past the KV length; None when not asked for.
        kept: ``(T, nb) bool`` kept blocks of each tile.
        eligible: ``(T, nb) bool`` blocks fully visible to the tile's first row
            (``J < (prefix + p_first) // Bk``): the correction may add those back.
        real: ``(nb, Bk) bool`` token exists (``J * Bk + i < kv_len``).
        stat_offset: statistics row of the request's block 0 (``block_offsets[b]``).
    """

    request: int
    kv_head: int
    segments: torch.Tensor
    row_tile: torch.Tensor
    out_rows: torch.Tensor
    out_heads: torch.Tensor
    queries: torch.Tensor
    weights: torch.Tensor
    row_max: torch.Tensor
    values: torch.Tensor | None
    kept: torch.Tensor
    eligible: torch.Tensor
    real: torch.Tensor
    stat_offset: int

    @property
    def num_blocks(self) -> int:
        """Key blocks ``nb`` the chunk covers."""
        return self.weights.shape[1]


def kept_block_mask(
    index: BlockIndex, segment_begin: int, ntiles: int, nblocks: int, device: torch.device
) -> torch.Tensor:
    """``(ntiles, nblocks) bool``: kept blocks of segments ``segment_begin .. segment_begin + ntiles - 1``.

    Args:
        index: the block index.
        segment_begin: first segment (tile 0 of one request and KV head).
        ntiles: consecutive segments to read.
        nblocks: key blocks of the request.
        device: device of the result.

    Returns:
        The mask, one row per tile.
    """
    offsets = index.offsets[segment_begin : segment_begin + ntiles + 1].to(device=device, dtype=torch.long)
    counts = offsets[1:] - offsets[:-1]
    begin, end = int(offsets[0]), int(offsets[-1])
    blocks = index.blocks[begin:end].to(device=device, dtype=torch.long)
    tiles = torch.repeat_interleave(torch.arange(ntiles, device=device), counts, output_size=end - begin)
    mask = torch.zeros(ntiles, nblocks, dtype=torch.bool, device=device)
    mask[tiles, blocks] = True
    return mask


def walk_tile_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    batch: PagedPrefillBatch,
    index: BlockIndex,
    shapes: PrefillShapes,
    *,
    scale: float,
    compute_dtype: torch.dtype,
    descales: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    stat_offsets: list[int] | None = None,
) -> Iterator[TileChunk]:
    """Yield the exact attention weights of every tile of ``index``, chunk by chunk (inputs already validated).

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        v_cache: paged values, or None when only the weights are needed.
        batch: the paged prefill batch.
        index: the block index (checked compatible with ``batch``).
        shapes: sizes from :func:`~fpv2.kernel.contracts.validate_prefill_inputs`.
        scale: softmax scale of the logits.
        compute_dtype: float32 or float64.
        descales: ``(q_descale, k_descale, v_descale)`` FP8 descales or Nones.
        stat_offsets: ``block_offsets`` of the statistics as a host list, or None.

    Yields:
        One :class:`TileChunk` per group of whole tiles, in segment order.
    """
    group, tile_size, block_size = shapes.group, index.tile_size, index.block_size
    device = q.device
    host = batch.host
    tile_offsets = index.tile_offsets.cpu().tolist()
    for b in range(batch.num_requests):
        q_len, prefix, kv_len, start = host.q_lens[b], host.prefix[b], host.seqlens_k[b], host.cu_seqlens_q[b]
        if q_len == 0:
            continue
        # Without values, K stands in for V (its gather is cheap next to the logits).
        q_b, k_b, v_b = request_operands(
            q, k_cache, k_cache if v_cache is None else v_cache, batch, b, shapes, compute_dtype, descales
        )
        nblocks = num_key_blocks(kv_len, block_size)
        ntiles = tile_offsets[b + 1] - tile_offsets[b]
        nrows = q_len * group
        tiles = torch.arange(ntiles, device=device)
        first_pos = (tiles * tile_size) // group
        eligible_all = torch.arange(nblocks, device=device)[None, :] < ((prefix + first_pos) // block_size)[:, None]
        # Whole tiles per chunk, as many as keep the logit matrix under CHUNK_ELEMENTS.
        tiles_per_chunk = max(1, CHUNK_ELEMENTS // (tile_size * max(nblocks, 1) * block_size))
        for h in range(shapes.num_kv_heads):
            seg_begin = index.num_kv_heads * tile_offsets[b] + h * ntiles  # SEGMENT_ORDER
            kept_all = kept_block_mask(index, seg_begin, ntiles, nblocks, device)
            packed = pack_queries(q_b, group, h)
            for t0 in range(0, ntiles, tiles_per_chunk):
                t1 = min(t0 + tiles_per_chunk, ntiles)
                r0, r1 = t0 * tile_size, min(t1 * tile_size, nrows)
                rows = torch.arange(r0, r1, device=device)
                nb = (prefix + (r1 - 1) // group) // block_size + 1  # blocks visible to the chunk's last row
                tokens = torch.arange(nb * block_size, device=device)
                real = tokens < kv_len
                keys = torch.zeros(nb * block_size, shapes.head_dim, dtype=compute_dtype, device=device)
                keys[: min(kv_len, nb * block_size)] = k_b[: nb * block_size, h]
                logits = (packed[r0:r1] @ keys.T) * scale
                visible = real[None, :] & (tokens[None, :] <= (prefix + rows // group)[:, None])
                logits = logits.masked_fill(~visible, -math.inf)
                # Every row sees at least its own key, so the maximum is finite.
                row_max = logits.amax(dim=1)
                weights = torch.exp(logits - row_max[:, None]).view(r1 - r0, nb, block_size)
                values = None
                if v_cache is not None:
                    values = torch.zeros(nb * block_size, shapes.head_dim, dtype=compute_dtype, device=device)
                    values[: min(kv_len, nb * block_size)] = v_b[: nb * block_size, h]
                    values = values.view(nb, block_size, shapes.head_dim)
                positions, heads = packed_rows_to_position_head(rows, group, h)
                yield TileChunk(
                    request=b,
                    kv_head=h,
                    segments=torch.arange(seg_begin + t0, seg_begin + t1, device=device),
                    row_tile=rows // tile_size - t0,
                    out_rows=start + positions,
                    out_heads=heads,
                    queries=packed[r0:r1],
                    weights=weights,
                    row_max=row_max,
                    values=values,
                    kept=kept_all[t0:t1, :nb],
                    eligible=eligible_all[t0:t1, :nb],
                    real=real.view(nb, block_size),
                    stat_offset=stat_offsets[b] if stat_offsets is not None else 0,
                )
