"""Static streaming selection (sink + window + diagonal band), the skeleton every scored strategy extends.

:class:`StreamingStrategy` keeps exactly the forced blocks of the config (the
StreamingLLM pattern of attention sinks plus a local window, with the whole
diagonal band of the tile) and honours the dense fallbacks; it reads no query
or key values.

:func:`select_with_forced` is the same walk over (request, KV head) with a hook:
a strategy passes a function returning the extra blocks it wants on top of the
forced ones, and gets the index with the forced blocks, the dense fallbacks and
the causal limit applied exactly as the max-threshold reference applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch, num_key_blocks

from ..config import SelectionConfig
from ..reference.csr import assemble_block_index
from ..reference.forced import dense_tile_mask, forced_block_mask, visible_block_mask
from ..reference.inputs import check_selection_inputs
from ..reference.tiles import RequestTiles, request_tiles, tile_rows
from .registry import register_strategy


@dataclass(frozen=True, eq=False)
class HeadSelectionInputs:
    """What a strategy sees of one (request, KV head) when it adds blocks to the forced ones.

    Attributes:
        request: request index ``b``.
        kv_head: KV head ``h``.
        group: GQA group size ``g``.
        q_len: new queries of the request.
        prefix: cached KV tokens before the first query.
        kv_len: ``seqlens_k`` of the request (prefix included).
        rows: ``(T, tile_size, d) float32`` packed query rows of ``kv_head`` (zero padding rows).
        tiles: the request's tile geometry.
        pooled_k: ``(nb, d) float32`` pooled keys of the request and KV head, in real units.
        scale: logit scale (softmax scale times the query descale), natural-log units.
        forced: ``(T, nb) bool`` sink, window and diagonal-band blocks of every tile.
        sparse: ``(T,) bool`` tiles that are not dense fallbacks (only these need extra blocks).
    """

    request: int
    kv_head: int
    group: int
    q_len: int
    prefix: int
    kv_len: int
    rows: torch.Tensor
    tiles: RequestTiles
    pooled_k: torch.Tensor
    scale: float
    forced: torch.Tensor
    sparse: torch.Tensor


#: Extra blocks of a strategy: ``(inputs, config) -> (T, nb) bool``; rows of dense tiles are ignored.
ExtraBlocks = Callable[[HeadSelectionInputs, SelectionConfig], torch.Tensor]


def select_with_forced(
    q: torch.Tensor,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics,
    *,
    config: SelectionConfig,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    extra: ExtraBlocks | None = None,
) -> BlockIndex:
    """The forced blocks of every tile, plus the blocks ``extra`` chooses, as a block index.

    Per (request, KV head) in segment order: ``keep = forced | extra(...)``; the
    dense-fallback tiles keep every visible block; everything is cut to the
    causally visible blocks.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        batch: the paged prefill batch.
        statistics: pooled keys (real units), pooled with ``config.block_size``.
        config: selection parameters.
        q_descale: ``(B, Hkv) float32`` query descales for FP8 queries (folded into ``scale``).
        k_descale: ``(B, Hkv) float32`` key descales; checked only, the statistics are dequantised.
        extra: returns the extra blocks of one (request, KV head); None keeps the forced blocks only
            (then no query row is read).

    Returns:
        The block index, built with ``config.tile_size`` and ``config.block_size``.

    Raises:
        TypeError, ValueError: inconsistent inputs, naming the argument; ``extra`` returned a mask of the
            wrong shape or dtype.
    """
    shapes = check_selection_inputs(q, batch, statistics, config, q_descale=q_descale, k_descale=k_descale)
    group, hkv = shapes.group, shapes.num_kv_heads
    base_scale = config.scale_for(shapes.head_dim)
    q_scales = q_descale.cpu().tolist() if q_descale is not None else None
    host = batch.host
    block_offsets = statistics.block_offsets.cpu().tolist()
    counts: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    for b in range(batch.num_requests):
        q_len, prefix, kv_len = host.q_lens[b], host.prefix[b], host.seqlens_k[b]
        if q_len == 0:
            continue
        tiles = request_tiles(
            q_len, prefix, group, tile_size=config.tile_size, block_size=config.block_size, device=q.device
        )
        nb = num_key_blocks(kv_len, config.block_size)
        visible = visible_block_mask(tiles, nb)
        dense = dense_tile_mask(tiles.num_tiles, kv_len, config, q.device)
        forced = forced_block_mask(tiles, nb, config)
        base = torch.where(dense[:, None], visible, forced & visible)
        if extra is None or bool(dense.all()):
            # Nothing depends on the head: one mask serves every KV head.
            count, kept = base.sum(dim=1, dtype=torch.int32), torch.nonzero(base)[:, 1].to(torch.int32)
            counts.extend([count] * hkv)
            ids.extend([kept] * hkv)
            continue
        q_b = q[host.cu_seqlens_q[b] : host.cu_seqlens_q[b + 1]]
        for h in range(hkv):
            inputs = HeadSelectionInputs(
                request=b,
                kv_head=h,
                group=group,
                q_len=q_len,
                prefix=prefix,
                kv_len=kv_len,
                rows=tile_rows(q_b, group, h, config.tile_size),
                tiles=tiles,
                pooled_k=statistics.pooled_k[block_offsets[b] : block_offsets[b] + nb, h],
                scale=base_scale * (q_scales[b][h] if q_scales is not None else 1.0),
                forced=forced,
                sparse=~dense,
            )
            chosen = extra(inputs, config)
            _check_extra(chosen, base, b, h)
            keep = base | (chosen & ~dense[:, None] & visible)
            counts.append(keep.sum(dim=1, dtype=torch.int32))
            ids.append(torch.nonzero(keep)[:, 1].to(torch.int32))
    return assemble_block_index(
        counts, ids, batch, group=group, num_kv_heads=hkv, tile_size=config.tile_size, block_size=config.block_size
    )


class ForcedPlusExtraSelection:
    """Base of the strategies that keep the forced blocks plus their own ``extra_blocks`` of each head.

    Subclasses define ``extra_blocks(inputs, config) -> (T, nb) bool``;
    :meth:`select` runs :func:`select_with_forced` with it.
    """

    def extra_blocks(self, inputs: HeadSelectionInputs, config: SelectionConfig) -> torch.Tensor:
        """The extra blocks of one (request, KV head); see :data:`ExtraBlocks`."""
        raise NotImplementedError(f"{type(self).__name__} must define extra_blocks(inputs, config)")

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
        """Select the forced blocks plus :meth:`extra_blocks` of every tile.

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            batch: the paged prefill batch.
            statistics: pooled keys (real units), pooled with ``config.block_size``.
            config: selection parameters.
            q_descale: ``(B, Hkv) float32`` query descales for FP8 queries.
            k_descale: ``(B, Hkv) float32`` key descales; checked only (the statistics are dequantised).

        Returns:
            The block index.

        Raises:
            TypeError, ValueError: inconsistent inputs, naming the argument.
        """
        return select_with_forced(
            q, batch, statistics, config=config, q_descale=q_descale, k_descale=k_descale, extra=self.extra_blocks
        )


def _check_extra(chosen: object, base: torch.Tensor, request: int, kv_head: int) -> None:
    """A strategy hook must return a bool mask shaped like the forced mask (a wrong one would broadcast)."""
    if (
        isinstance(chosen, torch.Tensor)
        and chosen.dtype == torch.bool
        and chosen.shape == base.shape
        and chosen.device == base.device
    ):
        return
    got = (
        f"shape {tuple(chosen.shape)}, dtype {chosen.dtype}, device {chosen.device}"
        if isinstance(chosen, torch.Tensor)
        else type(chosen)
    )
    raise ValueError(
        f"extra blocks of (request {request}, kv_head {kv_head}) must be a {tuple(base.shape)} bool tensor "
        f"on {base.device}; got {got}"
    )


@register_strategy("streaming")
@dataclass(frozen=True)
class StreamingStrategy:
    """Static streaming attention: attention sinks plus a local window, StreamingLLM-style, no scoring.

    Keeps, per tile, the sink blocks (``config.sink_tokens``), the window blocks
    (``config.window_tokens`` before the tile) and the whole diagonal band, and
    every visible block of the dense-fallback tiles (``config.dense_tail_tiles``,
    ``config.min_sparse_kv_len``). It has no parameters of its own: size the
    pattern through the config. ``alpha`` and ``probe_stride`` are ignored.

    Attributes:
        name: ``"streaming"``.
    """

    name: ClassVar[str] = "streaming"

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
        """Keep the forced blocks of every tile.

        Args:
            q: ``(total_q, Hq, d)`` packed queries (checked; only the shape is used).
            batch: the paged prefill batch.
            statistics: pooled keys; only their head count and block layout are used.
            config: selection parameters (block and tile size, sink, window, dense fallbacks).
            q_descale: checked like for any strategy, otherwise unused.
            k_descale: checked like for any strategy, otherwise unused.

        Returns:
            The block index.

        Raises:
            TypeError, ValueError: inconsistent inputs, naming the argument.
        """
        return select_with_forced(q, batch, statistics, config=config, q_descale=q_descale, k_descale=k_descale)
