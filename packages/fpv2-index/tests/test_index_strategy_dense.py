"""Dense strategy: every visible block of every tile (built from host lengths; its sync-freedom is a GPU test,
``fpv2-serving``'s ``test_sync_free``)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_testlib import kept_lists, make_case, tiles_of, visible_blocks
from test_index_strategy_streaming import batches

from fpv2.index import SelectionConfig
from fpv2.index.strategies import DenseStrategy
from fpv2.kernel.reference.pooling import pool_blocks

SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(shape=batches(), heads=st.sampled_from([(4, 4), (8, 2), (7, 1)]), block_size=st.sampled_from([16, 32]))
def test_dense_keeps_every_visible_block_of_every_tile(shape, heads, block_size):
    seqlens_q, seqlens_k = shape
    num_q_heads, num_kv_heads = heads
    group = num_q_heads // num_kv_heads
    cfg = SelectionConfig(block_size=block_size, tile_size=64, min_sparse_kv_len=0)
    case = make_case(
        seqlens_q,
        seqlens_k,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=64,
        page_size=16,
        block_size=block_size,
    )
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=block_size)
    index = DenseStrategy().select(case.q, case.batch, stats, config=cfg)
    index.check_compatible(case.batch, group, tile_size=cfg.tile_size)
    tiles = tiles_of(case.batch, group, num_kv_heads, cfg.tile_size)
    kept = kept_lists(index)
    assert len(kept) == len(tiles)
    for tile, ids in zip(tiles, kept):
        assert ids == sorted(visible_blocks(tile, block_size)), tile
    assert index.density(case.batch) == pytest.approx(1.0)
