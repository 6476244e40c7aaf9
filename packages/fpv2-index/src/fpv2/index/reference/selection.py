"""Max-threshold block selection: the readable definition every fast path is tested against.

Per segment (request, KV head, tile), in the block index's segment order:
keep block ``J`` when it is a candidate and ``E_J >= alpha * max_J E_J``
(energy space, see :mod:`.scoring`), then add the forced blocks (sink, window,
diagonal band, see :mod:`.forced`); dense-fallback tiles keep every visible
block. The result is a :class:`fpv2.kernel.BlockIndex`.

Pooled keys come from :class:`fpv2.kernel.BlockStatistics`, which holds them in
real units (FP8 descales already applied by the pooling), so the logit scale is
``softmax_scale * q_descale[b, h]``.
"""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch, num_key_blocks

from ..config import SelectionConfig
from .csr import assemble_block_index
from .forced import dense_tile_mask, forced_block_mask, visible_block_mask
from .inputs import check_selection_inputs
from .scoring import block_energies, block_energies_online
from .tiles import RequestTiles, request_tiles, tile_rows

#: Upper bound on the logits materialised at once (tiles x rows x blocks), to bound reference memory.
MAX_LOGITS_PER_STEP = 1 << 24


def threshold_mask(energies: torch.Tensor, num_scored: torch.Tensor, alpha: float) -> torch.Tensor:
    """``(T, nb) bool``: candidates whose energy reaches ``alpha`` times the tile's largest.

    Args:
        energies: ``(T, nb)`` block energies (0 for non-candidates).
        num_scored: ``(T,)`` candidates per tile.
        alpha: threshold ratio in ``(0, 1]``.

    Returns:
        The scored-and-kept mask; all False for a tile whose energies are all 0.
    """
    ids = torch.arange(energies.shape[1], device=energies.device)
    candidate = ids[None, :] < num_scored[:, None]
    peak = energies.amax(dim=1, keepdim=True) if energies.shape[1] else energies.new_zeros(energies.shape[0], 1)
    return candidate & (peak > 0) & (energies >= alpha * peak)


def request_keep_mask(
    rows: torch.Tensor,
    tiles: RequestTiles,
    pooled_k: torch.Tensor,
    kv_len: int,
    config: SelectionConfig,
    *,
    scale: float,
    online: bool = False,
) -> torch.Tensor:
    """Kept blocks of every tile of one (request, KV head).

    Args:
        rows: ``(T, tile_size, d) float32`` packed query rows.
        tiles: the request's tile geometry.
        pooled_k: ``(nb, d) float32`` pooled keys of the request and KV head.
        kv_len: ``seqlens_k`` of the request.
        config: selection parameters.
        scale: logit scale (softmax scale times the query descale).
        online: score with the single-pass online energies instead of the direct ones.

    Returns:
        ``(T, nb) bool`` kept-block mask.
    """
    nb = pooled_k.shape[0]
    visible = visible_block_mask(tiles, nb)
    dense = dense_tile_mask(tiles.num_tiles, kv_len, config, rows.device)
    keep = forced_block_mask(tiles, nb, config)
    sparse = torch.nonzero(~dense).flatten()
    if sparse.numel():
        num_scored = tiles.num_scored_blocks[sparse]
        candidates = int(num_scored.max())
        positions = tiles.probe_positions(config.probe_stride)[sparse]
        step = max(1, MAX_LOGITS_PER_STEP // (rows.shape[1] * max(candidates, 1)))
        score = block_energies_online if online else block_energies
        for begin in range(0, sparse.numel(), step):
            part = slice(begin, begin + step)
            energies, _ = score(
                rows[sparse[part]],
                positions[part],
                num_scored[part],
                pooled_k[:candidates],
                scale=scale,
                block_size=config.block_size,
            )
            scored = threshold_mask(energies, num_scored[part], config.alpha)
            keep[sparse[part], :candidates] |= scored
    keep[dense] = visible[dense]
    return keep & visible


def select_blocks(
    q: torch.Tensor,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics,
    *,
    config: SelectionConfig,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    online: bool = False,
) -> BlockIndex:
    """Reference max-threshold selection over a whole batch.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        batch: the prefill batch.
        statistics: pooled keys in real units, pooled with ``config.block_size``.
        config: selection parameters.
        q_descale: ``(B, Hkv) float32`` query descales (FP8 only).
        k_descale: ``(B, Hkv) float32`` key descales (FP8 only). Checked, but not
            applied again: the statistics are already dequantised.
        online: score with the online single-pass energies (as the fused kernel does).

    Returns:
        The :class:`~fpv2.kernel.BlockIndex`, on the batch's device.

    Raises:
        TypeError, ValueError: inconsistent inputs, naming the argument.
    """
    shapes = check_selection_inputs(q, batch, statistics, config, q_descale=q_descale, k_descale=k_descale)
    group, hkv = shapes.group, shapes.num_kv_heads
    base_scale = config.scale_for(shapes.head_dim)
    q_scales = q_descale.cpu().tolist() if q_descale is not None else None
    host = batch.host
    block_offsets = statistics.block_offsets.cpu().tolist()
    counts, ids = [], []
    for b in range(batch.num_requests):
        q_len, prefix, kv_len = host.q_lens[b], host.prefix[b], host.seqlens_k[b]
        if q_len == 0:
            continue
        tiles = request_tiles(
            q_len, prefix, group, tile_size=config.tile_size, block_size=config.block_size, device=q.device
        )
        q_b = q[host.cu_seqlens_q[b] : host.cu_seqlens_q[b + 1]]
        nb = num_key_blocks(kv_len, config.block_size)
        for h in range(hkv):
            scale = base_scale * (q_scales[b][h] if q_scales is not None else 1.0)
            pooled = statistics.pooled_k[block_offsets[b] : block_offsets[b] + nb, h]
            rows = tile_rows(q_b, group, h, config.tile_size)
            keep = request_keep_mask(rows, tiles, pooled, kv_len, config, scale=scale, online=online)
            counts.append(keep.sum(dim=1, dtype=torch.int32))
            ids.append(torch.nonzero(keep)[:, 1].to(torch.int32))
    return assemble_block_index(
        counts, ids, batch, group=group, num_kv_heads=hkv, tile_size=config.tile_size, block_size=config.block_size
    )
