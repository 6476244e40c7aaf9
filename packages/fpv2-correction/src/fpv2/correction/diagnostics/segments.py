"""Per-segment bookkeeping: which (request, KV head, tile) a segment is, and per-tile norms of row tensors."""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, PagedPrefillBatch


def segment_coordinates(index: BlockIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(request, kv_head, tile)`` of every segment, in the index's segment order.

    Segment ``s = num_kv_heads * tile_offsets[b] + h * ntiles_b + t``
    (:data:`fpv2.kernel.contracts.SEGMENT_ORDER`).

    Args:
        index: the block index.

    Returns:
        Three ``(S,) long`` tensors on the index's device.

    Raises:
        TypeError: ``index`` is not a :class:`~fpv2.kernel.BlockIndex`.
    """
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index must be a BlockIndex, got {type(index).__name__}")
    device = index.offsets.device
    tiles = index.tile_offsets.to(device=device, dtype=torch.long)
    ntiles = tiles[1:] - tiles[:-1]
    hkv = index.num_kv_heads
    request = torch.repeat_interleave(
        torch.arange(index.num_requests, device=device), ntiles * hkv, output_size=index.num_segments
    )
    local = torch.arange(index.num_segments, device=device) - hkv * tiles[:-1][request]
    per_head = ntiles[request]  # > 0 for every segment that exists
    return request, local // per_head, local % per_head


def tile_norms(x: torch.Tensor, batch: PagedPrefillBatch, index: BlockIndex) -> torch.Tensor:
    """Frobenius norm of ``x`` over each segment's PackGQA rows (all ``d`` columns).

    Args:
        x: ``(total_q, Hq, d)`` per-row vectors (an output, or an error of one).
        batch: the batch ``x`` belongs to.
        index: the block index whose segments define the tiles.

    Returns:
        ``(S,)`` norms in ``x``'s dtype, in segment order.

    Raises:
        TypeError: ``x`` is not a floating tensor.
        ValueError: ``x`` does not have ``total_q`` rows and a multiple of ``Hkv`` heads.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating torch.Tensor, got {type(x).__name__}")
    hkv = index.num_kv_heads
    if x.dim() != 3 or x.shape[0] != batch.total_q or x.shape[1] % hkv:
        raise ValueError(
            f"x must have shape ({batch.total_q}, Hq, d) with Hq a multiple of {hkv}; got shape {tuple(x.shape)}, "
            f"dtype {x.dtype}"
        )
    group, tile_size = x.shape[1] // hkv, index.tile_size
    squares = x.pow(2).sum(dim=2)  # (total_q, Hq)
    out = torch.zeros(index.num_segments, dtype=x.dtype, device=x.device)
    tile_offsets = index.tile_offsets.cpu().tolist()
    host = batch.host
    for b in range(batch.num_requests):
        q_len, start = host.q_lens[b], host.cu_seqlens_q[b]
        ntiles = tile_offsets[b + 1] - tile_offsets[b]
        if q_len == 0:
            continue
        # (q_len, Hkv, g) -> (Hkv, q_len * g): PackGQA rows of every KV head, padded to whole tiles.
        rows = squares[start : start + q_len].view(q_len, hkv, group).permute(1, 0, 2).reshape(hkv, q_len * group)
        padded = torch.zeros(hkv, ntiles * tile_size, dtype=x.dtype, device=x.device)
        padded[:, : q_len * group] = rows
        seg = hkv * tile_offsets[b]
        out[seg : seg + hkv * ntiles] = padded.view(hkv * ntiles, tile_size).sum(dim=1)
    return out.sqrt()


def pruned_block_counts(index: BlockIndex, batch: PagedPrefillBatch) -> torch.Tensor:
    """Causally visible blocks each segment does not keep.

    A tile sees blocks ``0 .. (prefix + p_last) // Bk``; the index keeps a subset of them.

    Args:
        index: the block index (checked compatible with ``batch`` by the caller).
        batch: the batch it was built for.

    Returns:
        ``(S,) long`` counts on the index's device, in segment order.
    """
    request, _, tile = segment_coordinates(index)
    device = request.device
    q_lens = batch.q_lens.to(device=device, dtype=torch.long)[request]
    prefix = batch.prefix.to(device=device, dtype=torch.long)[request]
    row_end = torch.minimum((tile + 1) * index.tile_size, q_lens * index.group)
    visible = (prefix + (row_end - 1) // index.group) // index.block_size + 1
    offsets = index.offsets.to(torch.long)
    return visible - (offsets[1:] - offsets[:-1])
