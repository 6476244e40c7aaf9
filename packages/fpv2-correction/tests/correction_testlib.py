"""Test inputs for fpv2-correction: paged caches with known contents, random block indexes, own geometry.

Geometry and pooling are recomputed here from their definitions (no
``tile_span``, ``gather_kv`` or ``pool_blocks``), so the tests do not share a
bug with the code under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fpv2.kernel import BlockIndex, PagedPrefillBatch


@dataclass(frozen=True, eq=False)
class Paged:
    """A paged K/V cache together with the contiguous per-request tensors scattered into it."""

    q: torch.Tensor  # (total_q, Hq, d)
    k_cache: torch.Tensor  # (num_pages, page_size, Hkv, d); unowned slots hold NaN
    v_cache: torch.Tensor
    batch: PagedPrefillBatch
    keys: list[torch.Tensor]  # per request (kv_len, Hkv, d) float32
    values: list[torch.Tensor]
    seqlens_q: list[int]
    seqlens_k: list[int]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k_cache.shape[2]

    @property
    def prefix(self) -> list[int]:
        return [k - q for q, k in zip(self.seqlens_q, self.seqlens_k)]

    @property
    def starts(self) -> list[int]:
        out = [0]
        for n in self.seqlens_q:
            out.append(out[-1] + n)
        return out


def make_paged(
    seqlens_q: list[int],
    seqlens_k: list[int],
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    seed: int = 0,
) -> Paged:
    """Random Q/K/V, K/V scattered through a shuffled page table (spare page and tails hold NaN)."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seqlens_k]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seqlens_k]
    q = 2.0 * torch.randn(sum(seqlens_q), num_q_heads, head_dim, generator=gen)
    pages = [-(-n // page_size) for n in seqlens_k]
    num_pages = sum(pages) + 1
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seqlens_k), max(max(pages), 1)), -1, dtype=torch.int32)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), math.nan)
    v_cache = torch.full_like(k_cache, math.nan)
    used = 0
    for b, (kv_len, n) in enumerate(zip(seqlens_k, pages)):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
        for i in range(kv_len):  # token by token: the page-table rule, spelled out
            k_cache[table[b, i // page_size], i % page_size] = keys[b][i]
            v_cache[table[b, i // page_size], i % page_size] = values[b][i]
    cu = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    batch = PagedPrefillBatch(cu, torch.tensor(seqlens_k, dtype=torch.int32), table, page_size, num_pages)
    return Paged(q, k_cache, v_cache, batch, keys, values, list(seqlens_q), list(seqlens_k))


def block_means(tokens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nb, Hkv, d)`` float64 means and ``(nb,)`` lengths, one block at a time (tail over its real length)."""
    nb = -(-tokens.shape[0] // block_size)
    means = [tokens[j * block_size : (j + 1) * block_size].double().mean(dim=0) for j in range(nb)]
    lengths = [min(block_size, tokens.shape[0] - j * block_size) for j in range(nb)]
    if not means:
        return torch.zeros(0, *tokens.shape[1:], dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    return torch.stack(means), torch.tensor(lengths)


@dataclass(frozen=True)
class Seg:
    """A segment (request, KV head, tile) with positions relative to the request's first query."""

    request: int
    kv_head: int
    tile: int
    row_begin: int
    row_end: int
    p_first: int
    p_last: int
    prefix: int
    kept: tuple[int, ...]

    def eligible(self, block_size: int) -> int:
        """Blocks entirely before the tile's first query position."""
        return (self.prefix + self.p_first) // block_size


def random_index(
    paged: Paged, *, tile_size: int, block_size: int, keep_prob: float, seed: int, keep_diagonal: bool = True
) -> tuple[BlockIndex, list[Seg]]:
    """A CSR index keeping each visible block with probability ``keep_prob`` (and the diagonal band)."""
    gen = torch.Generator().manual_seed(seed)
    g, hkv = paged.group, paged.k_cache.shape[2]
    offsets, blocks, tiles, segs = [0], [], [0], []
    for b, (q_len, prefix) in enumerate(zip(paged.seqlens_q, paged.prefix)):
        ntiles = -(-q_len * g // tile_size)
        tiles.append(tiles[-1] + ntiles)
        for h in range(hkv):
            for t in range(ntiles):
                r0, r1 = t * tile_size, min((t + 1) * tile_size, q_len * g)
                p_first, p_last = r0 // g, (r1 - 1) // g
                last_block = (prefix + p_last) // block_size
                draw = torch.rand(last_block + 1, generator=gen) < keep_prob
                kept = {j for j in range(last_block + 1) if draw[j]}
                if keep_diagonal:
                    kept |= set(range((prefix + p_first) // block_size, last_block + 1))
                kept = tuple(sorted(kept))
                blocks.extend(kept)
                offsets.append(len(blocks))
                segs.append(Seg(b, h, t, r0, r1, p_first, p_last, prefix, kept))
    index = BlockIndex(
        torch.tensor(offsets, dtype=torch.int32),
        torch.tensor(blocks, dtype=torch.int32),
        torch.tensor(tiles, dtype=torch.int32),
        num_kv_heads=hkv,
        group=g,
        tile_size=tile_size,
        block_size=block_size,
    )
    return index, segs


def decode_words(words: list[int]) -> list[int]:
    """Block ids whose bit is set, bit ``i`` of word ``w`` standing for block ``64 * w + i``."""
    out = []
    for w, word in enumerate(words):
        unsigned = word % (1 << 64)  # int64 storage: read the two's-complement bit pattern
        out.extend(64 * w + i for i in range(64) if unsigned >> i & 1)
    return out
