"""Structured attention inputs on which block selection is meaningful.

Random Gaussian Q/K give nearly uniform attention, so any max-threshold
selector keeps almost every block. The *planted* workload shifts a random
fraction of key blocks of each KV head along a head-specific unit direction
``u`` and shifts that head group's queries along ``u`` too, so those blocks carry
a logit margin of about ``margin`` over the rest. The optional *needle* is one
more planted block per head, far from the diagonal, that only a few queries
point at. With ``drift_tokens`` the N(0, 1) background is replaced by the
*drifting* one of :mod:`.drifting` (AR(1) along the sequence, a per-head mean,
RoPE); the planted shifts are added after the rotation, so they stay a content
match at any distance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..contracts import BLOCK_SIZE, PagedPrefillBatch, num_key_blocks
from .drifting import ar1_sequence, check_drift_tokens, rotary


@dataclass(frozen=True, eq=False)
class PlantedWorkload:
    """Inputs of one planted prefill call and what was planted in them."""

    q: torch.Tensor  # (total_q, Hq, d)
    k_cache: torch.Tensor  # (num_pages, page_size, Hkv, d)
    v_cache: torch.Tensor
    batch: PagedPrefillBatch
    planted_blocks: list[torch.Tensor]  # per request, (Hkv, nblocks) bool
    needle_rows: list[torch.Tensor]  # per request, (n, 2) long (query position, query head); empty without needle


def planted_workload(
    seqlens_q: list[int],
    seqlens_k: list[int] | None = None,
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 1,
    fraction: float = 0.02,
    margin: float = 7.0,
    block_size: int = BLOCK_SIZE,
    needle: bool = False,
    needle_queries: int = 4,
    shuffle_pages: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    drift_tokens: float | None = None,
) -> PlantedWorkload:
    """Build a planted workload (see the module docstring).

    Args:
        seqlens_q: new query tokens per request.
        seqlens_k: KV length per request (defaults to ``seqlens_q``: no prefix).
        fraction: share of key blocks planted per KV head (at least one block).
        margin: logit margin (in natural-log units after the softmax scale) of
            planted blocks over the rest.
        shuffle_pages: scatter pages randomly in the cache, so the page table matters.
        seed: generator seed; the same arguments give the same tensors.
        drift_tokens: None for the N(0, 1) background (BENCHMARKS.md's planted workload); a
            correlation length in tokens for the drifting background (see :mod:`.drifting`).
            Without it the tensors are exactly those of earlier versions.

    Raises:
        ValueError: ``drift_tokens`` given but not a positive finite number.
    """
    if drift_tokens is not None:
        drift_tokens = check_drift_tokens(drift_tokens)
    if seqlens_k is None:
        seqlens_k = list(seqlens_q)
    gen = torch.Generator().manual_seed(seed)
    group = num_q_heads // num_kv_heads
    # q.k scaled by 1/sqrt(d) gains amp_q * amp_k / sqrt(d) along u: split the margin evenly.
    amp = math.sqrt(margin * math.sqrt(head_dim))
    directions = torch.randn(num_kv_heads, head_dim, generator=gen)
    directions /= directions.norm(dim=1, keepdim=True)

    batch = PagedPrefillBatch.contiguous(seqlens_q, seqlens_k, page_size=page_size)
    num_pages = batch.num_pages
    perm = torch.randperm(num_pages, generator=gen) if shuffle_pages else torch.arange(num_pages)
    page_table = batch.page_table.clone()
    used = page_table >= 0
    page_table[used] = perm[page_table[used].long()].to(torch.int32)

    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=gen)
    q_parts, planted, needles = [], [], []
    for b, (q_len, kv_len) in enumerate(zip(seqlens_q, seqlens_k)):
        nblocks = num_key_blocks(kv_len, block_size)
        pos = torch.arange(kv_len)
        pages = page_table[b].long()[pos // page_size]
        slots = pos % page_size
        keys = k_cache[pages, slots]  # (kv_len, Hkv, d) copy
        chosen = torch.zeros(num_kv_heads, nblocks, dtype=torch.bool)
        q = torch.randn(q_len, num_q_heads, head_dim, generator=gen)
        if drift_tokens is not None:
            # Replaces the N(0, 1) draws above, which still run: one generator stream for both backgrounds
            # (the committed drifting results were made with it).
            keys, values, q = _drifting_background(kv_len, q_len, num_kv_heads, group, head_dim, drift_tokens, gen)
            v_cache[pages, slots] = values
        rows = []
        for h in range(num_kv_heads):
            if nblocks:
                count = max(1, round(fraction * nblocks))
                chosen[h, torch.randperm(nblocks, generator=gen)[:count]] = True
            token_mask = chosen[h].repeat_interleave(block_size)[:kv_len]
            keys[token_mask, h] += amp * directions[h]
            heads = slice(h * group, (h + 1) * group)
            q[:, heads] += amp * directions[h]
            if needle and nblocks > 2 and q_len > 0:
                rows.append(
                    _plant_needle(keys, q, h, group, kv_len, q_len, block_size, amp, head_dim, gen, needle_queries)
                )
        k_cache[pages, slots] = keys
        q_parts.append(q)
        planted.append(chosen)
        needles.append(torch.cat(rows) if rows else torch.empty(0, 2, dtype=torch.long))
    final = PagedPrefillBatch(batch.cu_seqlens_q, batch.seqlens_k, page_table, page_size, num_pages).to(device)
    return PlantedWorkload(
        q=torch.cat(q_parts).to(device=device, dtype=dtype),
        k_cache=k_cache.to(device=device, dtype=dtype),
        v_cache=v_cache.to(device=device, dtype=dtype),
        batch=final,
        planted_blocks=[c.to(device) for c in planted],
        needle_rows=[n.to(device) for n in needles],
    )


def _drifting_background(
    kv_len: int, q_len: int, num_kv_heads: int, group: int, head_dim: int, drift_tokens: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and queries of one request on the drifting background (queries are the last ``q_len`` tokens)."""
    head_mean = torch.randn(num_kv_heads, head_dim, generator=gen)
    keys = ar1_sequence(kv_len, (num_kv_heads, head_dim), drift_tokens, gen) + head_mean
    values = ar1_sequence(kv_len, (num_kv_heads, head_dim), drift_tokens, gen)
    q = ar1_sequence(q_len, (num_kv_heads * group, head_dim), drift_tokens, gen)
    q += head_mean.repeat_interleave(group, dim=0)
    keys = rotary(keys, torch.arange(kv_len))
    q = rotary(q, torch.arange(kv_len - q_len, kv_len))
    return keys, values, q


def _plant_needle(
    keys: torch.Tensor,
    q: torch.Tensor,
    kv_head: int,
    group: int,
    kv_len: int,
    q_len: int,
    block_size: int,
    amp: float,
    head_dim: int,
    gen: torch.Generator,
    count: int,
) -> torch.Tensor:
    """Plant one needle block in the first half of the KV and point ``count`` late queries at it."""
    needle_dir = torch.randn(head_dim, generator=gen)
    needle_dir /= needle_dir.norm()
    half_blocks = max(1, num_key_blocks(kv_len, block_size) // 2)
    block = int(torch.randint(0, half_blocks, (1,), generator=gen))
    keys[block * block_size : min((block + 1) * block_size, kv_len), kv_head] += 2 * amp * needle_dir
    positions = torch.randint(q_len - max(1, q_len // 4), q_len, (count,), generator=gen)
    heads = kv_head * group + torch.randint(0, group, (count,), generator=gen)
    q[positions, heads] += 2 * amp * needle_dir
    return torch.stack([positions, heads], dim=1)
