"""Planted workload: planted blocks are found, and little else is kept."""

from __future__ import annotations

import pytest
import torch
from index_testlib import expected_forced, is_dense, kept_lists, tiles_of, visible_blocks

from fpv2.index import SelectionConfig, build_block_index
from fpv2.kernel.testing import planted_workload


@pytest.mark.parametrize(("kv_len", "max_density"), [(2048, 0.6), (4096, 0.4)])
def test_planted_blocks_are_kept_and_the_index_is_sparse(kv_len, max_density):
    # Request 0 is a plain prefill, request 1 continues a cached prefix of half its KV.
    w = planted_workload(
        [kv_len, kv_len // 2],
        [kv_len, kv_len],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        fraction=0.05,
        dtype=torch.float32,
        seed=3,
    )
    cfg = SelectionConfig(min_sparse_kv_len=0, sink_tokens=128, window_tokens=128)
    index = build_block_index(w.q, w.k_cache, w.batch, config=cfg)
    index.check_compatible(w.batch, 4, tile_size=cfg.tile_size)

    found = planted_pairs = extra = scored_free = 0
    for tile, kept in zip(tiles_of(w.batch, 4, 2, cfg.tile_size), kept_lists(index)):
        planted = set(torch.nonzero(w.planted_blocks[tile.request][tile.kv_head]).flatten().tolist())
        visible = visible_blocks(tile, cfg.block_size)
        planted_pairs += len(planted & visible)
        found += len(planted & visible & set(kept))
        candidates = set(range((tile.last + 1) // cfg.block_size))
        if not is_dense(tile, cfg) and planted & candidates:
            # A planted candidate dominates the tile's energies (tiles without one see near-uniform scores).
            free = visible - expected_forced(tile, cfg) - planted  # blocks only the scores could keep
            scored_free += len(free)
            extra += len(free & set(kept))
    assert planted_pairs > 50 and scored_free > 200
    assert found / planted_pairs >= 0.95, f"recall {found}/{planted_pairs}"
    # Unplanted blocks carry about exp(-margin) of a planted block's energy: nearly none passes alpha = 0.1.
    assert extra <= 0.02 * scored_free, f"{extra} of {scored_free} unforced, unplanted blocks kept"
    density = index.density(w.batch)
    assert density < max_density, f"density {density:.3f}"
    # Lowering alpha to its floor keeps more, raising it to 1 keeps at most the forced blocks and the peak block.
    loose = build_block_index(w.q, w.k_cache, w.batch, config=SelectionConfig(**{**cfg.__dict__, "alpha": 1e-6}))
    assert loose.nnz > index.nnz
