"""Assembling per-tile kept blocks, produced in segment order, into the CSR block index."""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, PagedPrefillBatch, expected_tile_offsets

from ..transfer import device_ints


def assemble_block_index(
    counts: list[torch.Tensor],
    ids: list[torch.Tensor],
    batch: PagedPrefillBatch,
    *,
    group: int,
    num_kv_heads: int,
    tile_size: int,
    block_size: int,
    check_values: bool = True,
) -> BlockIndex:
    """Concatenate per-(request, KV head) pieces into a :class:`~fpv2.kernel.BlockIndex`.

    Args:
        counts: one ``(T_b,) int32`` tensor per (request, KV head) with a tile, in
            segment order (request-major, then KV head): kept blocks per tile.
        ids: matching ``(sum counts,) int32`` ascending block ids, tile after tile.
        batch: the prefill batch (fixes ``tile_offsets`` and the device).
        group: GQA group size the tiles were packed with.
        num_kv_heads: ``Hkv``.
        tile_size: packed rows per tile.
        block_size: tokens per key block.
        check_values: check the CSR's values on construction (:meth:`~fpv2.kernel.BlockIndex.validate_values`:
            copies every id to the host); strategies whose ids are correct by construction pass False.

    Returns:
        The block index on the batch's device.
    """
    device = batch.device
    all_counts = torch.cat(counts).to(device) if counts else torch.zeros(0, dtype=torch.int32, device=device)
    offsets = torch.zeros(all_counts.numel() + 1, dtype=torch.int32, device=device)
    offsets[1:] = all_counts.cumsum(0)
    blocks = torch.cat(ids).to(device) if ids else torch.zeros(0, dtype=torch.int32, device=device)
    return BlockIndex(
        offsets=offsets,
        blocks=blocks.to(torch.int32).contiguous(),
        tile_offsets=expected_tile_offsets(batch, group, tile_size).to(device),
        num_kv_heads=num_kv_heads,
        group=group,
        tile_size=tile_size,
        block_size=block_size,
        check_values=check_values,
    )


def leading_blocks_index(
    visible: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    num_kv_heads: int,
    group: int,
    tile_size: int,
    block_size: int,
) -> BlockIndex:
    """The block index in which segment ``s`` keeps blocks ``0 .. visible[s] - 1``, built without a host sync.

    The offsets are summed on the host and copied once from pinned memory (a pageable copy would make the
    host wait for the stream); the ids are expanded on the device. Correct by construction (ascending
    ranges), so the CSR values are not checked (that would copy every id to the host).

    Args:
        visible: ``(S,)`` host integer tensor, blocks kept per segment in segment order
            (request-major, then KV head, then tile).
        batch: the prefill batch (fixes ``tile_offsets`` and the device).
        num_kv_heads: ``Hkv``.
        group: GQA group size the tiles were packed with.
        tile_size: packed rows per tile.
        block_size: tokens per key block.

    Returns:
        The block index on the batch's device (exact size, no spare capacity).
    """
    offsets_host = torch.zeros(visible.numel() + 1, dtype=torch.int64)
    torch.cumsum(visible.to(torch.int64), dim=0, out=offsets_host[1:])
    total = int(offsets_host[-1])
    device = batch.device
    offsets = device_ints(offsets_host, device)
    starts = offsets[:-1].long()
    segment_start = torch.repeat_interleave(starts, offsets[1:].long() - starts, output_size=total)
    blocks = (torch.arange(total, device=device) - segment_start).to(torch.int32)
    tile_offsets = device_ints(expected_tile_offsets(batch, group, tile_size), device)
    return BlockIndex(offsets, blocks, tile_offsets, num_kv_heads, group, tile_size, block_size, check_values=False)
