"""Top-k strategy: contract, parameter checks, and the k best unforced blocks per tile against a float64 oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from index_testlib import is_dense, kept_lists, make_case, oracle_energies, oracle_pooled, tiles_of, visible_blocks
from test_index_strategy_streaming import SETTINGS, batches, check_contract, configs, draw_case

from fpv2.index import SelectionConfig, build_block_index, get_strategy
from fpv2.index.strategies import TopKStrategy
from fpv2.index.strategies.top_k import top_k_mask
from fpv2.kernel.reference.pooling import pool_blocks
from fpv2.kernel.testing import planted_workload

#: Energies closer than this (relative to the tile's peak) may be ranked either way by fp32 rounding.
NEAR = 1e-4


def check_top_k(case, index, cfg, k):
    """Every sparse tile keeps its forced blocks plus exactly the min(k, c) best unforced candidates."""
    scale = 1.0 / math.sqrt(case.q.shape[2])
    pooled = {}
    extra_total = 0
    for tile, ids, forced in check_contract(case, index, cfg):
        if is_dense(tile, cfg):
            continue
        key = (tile.request, tile.kv_head)
        if key not in pooled:
            pooled[key] = oracle_pooled(case, tile.request, tile.kv_head, cfg.block_size)
        energies = oracle_energies(case, tile, cfg, scale, pooled[key])
        rankable = set(range(energies.numel())) - forced
        extra = ids - forced
        assert len(extra) == min(k, len(rankable)), f"{tile}: {len(extra)} scored blocks, k={k}, {len(rankable)} free"
        assert extra <= rankable, f"{tile}: keeps non-candidates {extra - rankable}"
        left = rankable - extra
        if extra and left:
            tol = NEAR * float(energies.max())
            weakest_kept = min(float(energies[j]) for j in extra)
            strongest_left = max(float(energies[j]) for j in left)
            assert weakest_kept >= strongest_left - tol, f"{tile}: kept {sorted(extra)} over stronger {sorted(left)}"
        extra_total += len(extra)
    return extra_total


@pytest.mark.parametrize("group", [1, 4, 8])
@SETTINGS
@given(
    shape=batches(),
    cfg=configs(),
    page_size=st.sampled_from([1, 16]),
    k=st.integers(1, 6),
    seed=st.integers(0, 100),
)
def test_contract_and_the_k_best_blocks(group, shape, cfg, page_size, k, seed):
    case = draw_case(shape, group, page_size, cfg, seed)
    index = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy=TopKStrategy(k=k))
    check_top_k(case, index, cfg, k)


def test_k_blocks_beyond_the_forced_ones_on_a_long_request():
    cfg = SelectionConfig(block_size=32, tile_size=64, sink_tokens=32, window_tokens=64, min_sparse_kv_len=0)
    case = make_case([400, 90], [1200, 90], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, block_size=32)
    for k in (1, 3, 10):
        index = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy=TopKStrategy(k=k))
        assert check_top_k(case, index, cfg, k) >= 40 * k  # 24 scored tiles per KV head
    # A budget above every tile's candidate count keeps every candidate: forced plus all fully visible blocks.
    everything = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy=TopKStrategy(k=10_000))
    for tile, ids, forced in check_contract(case, everything, cfg):
        expected = visible_blocks(tile, 32) if is_dense(tile, cfg) else forced | set(range((tile.last + 1) // 32))
        assert ids == expected


def test_planted_blocks_fill_the_budget():
    w = planted_workload(
        [2048], num_q_heads=8, num_kv_heads=2, head_dim=64, fraction=0.05, block_size=64, dtype=torch.float32, seed=5
    )
    cfg = SelectionConfig(block_size=64, sink_tokens=64, window_tokens=64, min_sparse_kv_len=0)
    planted_count = int(w.planted_blocks[0].sum(dim=1).max())
    index = build_block_index(w.q, w.k_cache, w.batch, config=cfg, strategy=TopKStrategy(k=planted_count))
    found = pairs = 0
    for tile, ids in zip(tiles_of(w.batch, 4, 2, 128), kept_lists(index)):
        planted = set(torch.nonzero(w.planted_blocks[0][tile.kv_head]).flatten().tolist())
        candidates = set(range((tile.last + 1) // 64))
        pairs += len(planted & candidates)
        found += len(planted & candidates & set(ids))
    assert pairs > 20 and found == pairs  # a planted block's margin dwarfs every other block's energy


def test_registered_default_and_pipeline_api():
    cfg = SelectionConfig(block_size=32, tile_size=64, sink_tokens=32, window_tokens=64, min_sparse_kv_len=0)
    case = make_case([300], [700], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, block_size=32)
    by_name = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy="top_k")
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)
    direct = TopKStrategy(k=32).select(case.q, case.batch, stats, config=cfg)
    assert torch.equal(by_name.offsets, direct.offsets) and torch.equal(by_name.blocks, direct.blocks)
    assert get_strategy("top_k").k == 32
    smaller = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy=TopKStrategy(k=2))
    assert smaller.nnz < by_name.nnz
    # alpha plays no part in top-k.
    other_alpha = SelectionConfig(**{**cfg.__dict__, "alpha": 0.9})
    same = build_block_index(case.q, case.k_cache, case.batch, config=other_alpha, strategy=TopKStrategy(k=2))
    assert torch.equal(same.blocks, smaller.blocks)


def test_top_k_mask_by_hand():
    energies = torch.tensor([[0.5, 2.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    rankable = torch.tensor([[True, True, True, False, True], [False, False, True, True, False]])
    got = top_k_mask(energies, rankable, 2)
    # Row 0: blocks 1 and 2 (block 3 is not rankable); row 1: both rankable ones (fewer than k).
    assert got.tolist() == [[False, True, True, False, False], [False, False, True, True, False]]
    ties = top_k_mask(torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool), 3)
    assert ties.tolist() == [[True, True, True, False]]  # ties go to the lower block ids
    assert not top_k_mask(energies, rankable, 0).any()


@pytest.mark.parametrize(("k", "error"), [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_k(k, error):
    with pytest.raises(error, match="TopKStrategy.k must"):
        TopKStrategy(k=k)
    with pytest.raises(TypeError, match=r"TopKStrategy.k must be an int, got str '4'"):
        TopKStrategy(k="4")
