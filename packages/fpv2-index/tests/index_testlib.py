"""Test inputs and independent oracles for fpv2-index.

The oracles are written from ALGORITHM.md section 3 with plain loops and their
own geometry (no ``tile_span``, ``pack_queries``, ``gather_kv`` or
``pool_blocks``), so a bug in a shared helper cannot hide in both the code and
its test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel import BlockIndex, PagedPrefillBatch
from fpv2.kernel.testing import planted_workload


@dataclass(frozen=True, eq=False)
class Case:
    """A paged prefill call plus the contiguous per-request keys it was scattered from."""

    q: torch.Tensor  # (total_q, Hq, d)
    k_cache: torch.Tensor  # (num_pages, page_size, Hkv, d); slots no request owns hold NaN
    batch: PagedPrefillBatch
    keys: list[torch.Tensor]  # per request (kv_len, Hkv, d) float32
    seqlens_q: list[int]
    seqlens_k: list[int]
    num_kv_heads: int

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.num_kv_heads

    @property
    def starts(self) -> list[int]:
        out = [0]
        for n in self.seqlens_q:
            out.append(out[-1] + n)
        return out


def make_case(
    seqlens_q: list[int],
    seqlens_k: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    block_size: int = 128,
    fraction: float = 0.1,
    margin: float = 5.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Planted Q/K (so selection is meaningful), re-scattered into a ``page_size`` cache by a random permutation."""
    w = planted_workload(
        seqlens_q,
        seqlens_k,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=1,
        fraction=fraction,
        margin=margin,
        block_size=block_size,
        shuffle_pages=False,
        dtype=torch.float32,
        seed=seed,
    )
    # page_size=1 without shuffling: request b's token i is page (sum of earlier seqlens_k) + i.
    keys, start = [], 0
    for kv_len in seqlens_k:
        keys.append(w.k_cache[start : start + kv_len, 0].to(dtype).float())
        start += kv_len
    gen = torch.Generator().manual_seed(seed + 1)
    pages = [-(-n // page_size) for n in seqlens_k]
    num_pages = sum(pages) + 1  # one spare page nobody owns
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seqlens_k), max(max(pages), 1)), -1, dtype=torch.int32)
    cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), math.nan)
    used = 0
    for b, (kv_len, n) in enumerate(zip(seqlens_k, pages)):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
        tok = torch.arange(kv_len)
        cache[table[b].long()[tok // page_size], tok % page_size] = keys[b]
    cu = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    batch = PagedPrefillBatch(cu, torch.tensor(seqlens_k, dtype=torch.int32), table, page_size, num_pages)
    return Case(w.q.to(dtype), cache.to(dtype), batch, keys, list(seqlens_q), list(seqlens_k), num_kv_heads)


@dataclass(frozen=True)
class Tile:
    """One (request, KV head, tile) with its geometry, computed here from first principles."""

    request: int
    kv_head: int
    tile: int
    num_tiles: int
    row_begin: int
    row_end: int
    first: int  # absolute position of the first row
    last: int  # absolute position of the last row
    kv_len: int


def tiles_of(case_batch: PagedPrefillBatch, group: int, num_kv_heads: int, tile_size: int) -> list[Tile]:
    """Every segment in segment order (request, KV head, tile)."""
    cu = case_batch.cu_seqlens_q.tolist()
    sk = case_batch.seqlens_k.tolist()
    out = []
    for b in range(len(sk)):
        q_len = cu[b + 1] - cu[b]
        prefix = sk[b] - q_len
        rows = q_len * group
        ntiles = (rows + tile_size - 1) // tile_size
        for h in range(num_kv_heads):
            for t in range(ntiles):
                r0, r1 = t * tile_size, min((t + 1) * tile_size, rows)
                out.append(Tile(b, h, t, ntiles, r0, r1, prefix + r0 // group, prefix + (r1 - 1) // group, sk[b]))
    return out


def kept_lists(index: BlockIndex) -> list[list[int]]:
    """Kept ids of every segment, in segment order."""
    off = index.offsets.tolist()
    blocks = index.blocks.tolist()
    return [blocks[off[s] : off[s + 1]] for s in range(len(off) - 1)]


def visible_blocks(tile: Tile, bk: int) -> set[int]:
    """Blocks whose first token the tile's last row may see."""
    return {j for j in range(tile.kv_len // bk + 1) if j * bk <= tile.last}


def expected_forced(tile: Tile, config: SelectionConfig) -> set[int]:
    """Sink, window and diagonal blocks by their token-level definitions (overlap tests)."""
    bk = config.block_size
    forced = set()
    for j in visible_blocks(tile, bk):
        lo, hi = j * bk, (j + 1) * bk - 1  # tokens of block j
        if lo < config.sink_tokens:
            forced.add(j)
        w_lo, w_hi = max(0, tile.first - config.window_tokens), tile.first - 1
        if config.window_tokens > 0 and w_lo <= w_hi and lo <= w_hi and hi >= w_lo:
            forced.add(j)
        if lo <= tile.last and hi >= tile.first:  # overlaps the tile's query positions
            forced.add(j)
    return forced


def is_dense(tile: Tile, config: SelectionConfig) -> bool:
    """Dense fallbacks: tail tiles and short requests."""
    return tile.kv_len < config.min_sparse_kv_len or tile.tile >= tile.num_tiles - config.dense_tail_tiles


def oracle_pooled(case: Case, request: int, kv_head: int, bk: int) -> torch.Tensor:
    """``(nb, d) float64`` block means, one block at a time (the tail block over its real length)."""
    keys = case.keys[request][:, kv_head].double()
    nb = -(-keys.shape[0] // bk)
    if nb == 0:
        return torch.zeros(0, keys.shape[1], dtype=torch.float64)
    return torch.stack([keys[j * bk : (j + 1) * bk].mean(dim=0) for j in range(nb)])


def oracle_energies(
    case: Case, tile: Tile, config: SelectionConfig, scale: float, pooled: torch.Tensor
) -> torch.Tensor:
    """Energies ``sum_r exp(s_rJ - M)`` of one tile's candidates, in float64 natural-log units."""
    bk, g = config.block_size, case.group
    rows = torch.arange(tile.row_begin, tile.row_end, config.probe_stride)  # probed rows, from the tile's first
    start = case.starts[tile.request]
    qrows = case.q[start + rows // g, tile.kv_head * g + rows % g].double()
    pos = tile.first - tile.row_begin // g + rows // g  # absolute position of each probed row
    candidates = (tile.last + 1) // bk  # blocks whose every token the last row sees
    logits = qrows @ pooled[:candidates].T * scale
    contrib = torch.arange(candidates)[None, :] * bk <= pos[:, None]  # the row sees the block's first token
    if not contrib.any():
        return torch.zeros(candidates, dtype=torch.float64)
    m = logits[contrib].max()
    return torch.where(contrib, torch.exp(logits - m), torch.zeros_like(logits)).sum(dim=0)


def oracle_selection(case: Case, config: SelectionConfig, rel_tol: float = 1e-4) -> list[tuple[set[int], set[int]]]:
    """Per segment: (kept blocks, blocks too close to the threshold to call) from the float64 oracle."""
    scale = config.softmax_scale or 1.0 / math.sqrt(case.q.shape[2])
    out, pooled = [], {}
    for tile in tiles_of(case.batch, case.group, case.num_kv_heads, config.tile_size):
        key = (tile.request, tile.kv_head)
        if key not in pooled:
            pooled[key] = oracle_pooled(case, tile.request, tile.kv_head, config.block_size)
        visible = visible_blocks(tile, config.block_size)
        if is_dense(tile, config):
            out.append((visible, set()))
            continue
        energies = oracle_energies(case, tile, config, scale, pooled[key]).tolist()
        peak = max(energies, default=0.0)
        kept, unsure = set(expected_forced(tile, config)), set()
        for j, e in enumerate(energies):
            if peak <= 0:
                continue
            if abs(e - config.alpha * peak) <= rel_tol * peak:
                unsure.add(j)
            elif e >= config.alpha * peak:
                kept.add(j)
        out.append((kept & visible, unsure - kept))
    return out
