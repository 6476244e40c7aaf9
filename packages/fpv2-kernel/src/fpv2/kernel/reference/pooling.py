"""Block mean pooling of keys and values (tail-aware, fp32 accumulation)."""

from __future__ import annotations

import torch

from ..contracts import BLOCK_SIZE, BlockStatistics, PagedPrefillBatch, num_key_blocks
from .paged import gather_kv


def pool_request(tokens: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of each ``block_size`` run of ``(L, Hkv, d)`` tokens.

    Returns ``(pooled (nblocks, Hkv, d) float32, lengths (nblocks,) int32)``; the
    tail block is averaged over its real length, not padded with zeros.
    """
    kv_len, heads, d = tokens.shape
    nblocks = num_key_blocks(kv_len, block_size)
    padded = torch.zeros(nblocks * block_size, heads, d, dtype=torch.float32, device=tokens.device)
    padded[:kv_len] = tokens.float()
    sums = padded.view(nblocks, block_size, heads, d).sum(dim=1)
    lengths = torch.full((nblocks,), block_size, dtype=torch.int32, device=tokens.device)
    if nblocks and kv_len % block_size:
        lengths[-1] = kv_len % block_size
    return sums / lengths[:, None, None].float(), lengths


def pool_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    batch: PagedPrefillBatch,
    *,
    block_size: int = BLOCK_SIZE,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> BlockStatistics:
    """Pooled K (and V) of every block of every request, read through the page table.

    FP8 caches are dequantised with the per (request, KV head) descales before
    pooling, so the statistics are in real units.
    """
    pooled_k, pooled_v, lengths, counts = [], [], [], []
    for b in range(batch.num_requests):
        k = gather_kv(k_cache, batch, b).float()
        if k_descale is not None:
            k = k * k_descale[b][None, :, None]
        pk, ln = pool_request(k, block_size)
        pooled_k.append(pk)
        lengths.append(ln)
        counts.append(pk.shape[0])
        if v_cache is not None:
            v = gather_kv(v_cache, batch, b).float()
            if v_descale is not None:
                v = v * v_descale[b][None, :, None]
            pooled_v.append(pool_request(v, block_size)[0])
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32, device=batch.device)
    offsets[1:] = torch.tensor(counts, dtype=torch.int32, device=batch.device).cumsum(0)
    return BlockStatistics(
        pooled_k=torch.cat(pooled_k).contiguous(),
        pooled_v=torch.cat(pooled_v).contiguous() if v_cache is not None else None,
        block_lengths=torch.cat(lengths).contiguous(),
        block_offsets=offsets,
        block_size=block_size,
    )
