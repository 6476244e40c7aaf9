"""Top-p strategy: contract, parameter checks, and the minimal energy prefix against a sorted float64 oracle."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from index_testlib import is_dense, kept_lists, make_case, oracle_energies, oracle_pooled, visible_blocks
from test_index_strategy_streaming import SETTINGS, batches, check_contract, configs, draw_case

from fpv2.index import SelectionConfig, build_block_index, get_strategy
from fpv2.index.strategies import TopPStrategy
from fpv2.index.strategies.top_p import top_p_mask
from fpv2.kernel.reference.pooling import pool_blocks

#: Relative distance (to the tile's total or peak energy) within which fp32 rounding may flip a block.
NEAR = 1e-4


def oracle_top_p(energies: torch.Tensor, forced: set[int], p: float) -> tuple[set[int], set[int]]:
    """(needed unforced blocks, blocks too close to the cut to call) by sorting float64 energies."""
    values = energies.tolist()
    total, peak = sum(values), max(values, default=0.0)
    target = p * total
    have = sum(values[j] for j in forced if j < len(values))
    ranked = sorted((j for j in range(len(values)) if j not in forced), key=lambda j: (-values[j], j))
    needed, unsure = set(), set()
    for j in ranked:
        if values[j] <= 0:
            break
        if abs(have - target) <= NEAR * total:  # fp32 sums may land on either side of the target
            unsure.add(j)
        if have >= target:
            break
        needed.add(j)
        have += values[j]
    left = [values[j] for j in ranked if j not in needed]
    if needed and left:
        cut, runner_up = min(values[j] for j in needed), max(left)
        if cut - runner_up <= NEAR * peak:  # near-ties across the cut may be ranked either way
            unsure |= {j for j in ranked if min(abs(values[j] - cut), abs(values[j] - runner_up)) <= NEAR * peak}
    return needed, unsure


def check_top_p(case, index, cfg, p):
    """Every sparse tile keeps its forced blocks plus the oracle's minimal prefix (up to near-cut flips)."""
    scale = 1.0 / math.sqrt(case.q.shape[2])
    pooled, scored = {}, 0
    for tile, ids, forced in check_contract(case, index, cfg):
        if is_dense(tile, cfg):
            continue
        key = (tile.request, tile.kv_head)
        if key not in pooled:
            pooled[key] = oracle_pooled(case, tile.request, tile.kv_head, cfg.block_size)
        energies = oracle_energies(case, tile, cfg, scale, pooled[key])
        needed, unsure = oracle_top_p(energies, forced, p)
        extra = ids - forced
        assert needed - unsure <= extra, f"{tile}: misses {sorted(needed - unsure - extra)} of {sorted(needed)}"
        assert extra <= needed | unsure, f"{tile}: keeps {sorted(extra - needed - unsure)} beyond {sorted(needed)}"
        if not unsure:
            assert len(extra) == len(needed)
        scored += len(needed)
    return scored


@pytest.mark.parametrize("group", [1, 4, 8])
@SETTINGS
@given(
    shape=batches(),
    cfg=configs(),
    page_size=st.sampled_from([1, 16]),
    p=st.sampled_from([0.3, 0.8, 0.95, 1.0]),
    seed=st.integers(0, 100),
)
def test_contract_and_the_minimal_prefix(group, shape, cfg, page_size, p, seed):
    case = draw_case(shape, group, page_size, cfg, seed)
    index = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy=TopPStrategy(p=p))
    check_top_p(case, index, cfg, p)


@pytest.fixture(scope="module")
def long_case():
    cfg = SelectionConfig(block_size=32, tile_size=64, sink_tokens=32, window_tokens=64, min_sparse_kv_len=0)
    case = make_case(
        [400, 90], [1200, 90], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, block_size=32, margin=3.0
    )
    return case, cfg


def test_larger_p_keeps_a_superset(long_case):
    case, cfg = long_case
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)
    indexes = [TopPStrategy(p=p).select(case.q, case.batch, stats, config=cfg) for p in (0.2, 0.6, 0.9, 1.0)]
    for p, index in zip((0.2, 0.6, 0.9, 1.0), indexes):
        assert check_top_p(case, index, cfg, p) > 0
    for smaller, larger in itertools.pairwise(indexes):
        assert all(set(a) <= set(b) for a, b in zip(kept_lists(smaller), kept_lists(larger)))
        assert smaller.nnz < larger.nnz
    # p = 1 needs every candidate with any energy: here all of them, so forced plus every fully visible block.
    for tile, ids, forced in check_contract(case, indexes[-1], cfg):
        expected = visible_blocks(tile, 32) if is_dense(tile, cfg) else forced | set(range((tile.last + 1) // 32))
        assert ids == expected


def test_registered_default_and_pipeline_api(long_case):
    case, cfg = long_case
    by_name = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy="top_p")
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)
    direct = TopPStrategy(p=0.9).select(case.q, case.batch, stats, config=cfg)
    assert torch.equal(by_name.offsets, direct.offsets) and torch.equal(by_name.blocks, direct.blocks)
    assert get_strategy("top_p").p == 0.9
    assert check_top_p(case, by_name, cfg, 0.9) > 40


def test_top_p_mask_by_hand():
    energies = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    candidates = torch.tensor([[True, True, True, True, True]])
    nothing = torch.zeros_like(candidates)
    # Total 10: p = 0.5 needs 4 + 3 (4 alone is short of 5); p = 0.7 is reached exactly by 4 + 3.
    assert top_p_mask(energies, candidates, nothing, 0.5).tolist() == [[True, True, False, False, False]]
    assert top_p_mask(energies, candidates, nothing, 0.7).tolist() == [[True, True, False, False, False]]
    assert top_p_mask(energies, candidates, nothing, 0.71).tolist() == [[True, True, True, False, False]]
    # p = 1 takes every block with energy, never the zero-energy one.
    assert top_p_mask(energies, candidates, nothing, 1.0).tolist() == [[True, True, True, True, False]]
    # A forced block's energy counts first: forced block 0 (4 of 10) leaves 1 to reach 5, which block 1 brings.
    forced = torch.tensor([[True, False, False, False, False]])
    assert top_p_mask(energies, candidates, forced, 0.5).tolist() == [[False, True, False, False, False]]
    assert not top_p_mask(energies, candidates, forced, 0.4).any()
    # Non-candidates neither count nor get chosen; a tile without energy keeps nothing.
    partial = torch.tensor([[False, True, True, True, True]])
    assert top_p_mask(energies, partial, nothing, 0.5).tolist() == [[False, True, False, False, False]]  # 3 of 6
    assert top_p_mask(energies, partial, nothing, 0.6).tolist() == [[False, True, True, False, False]]
    assert not top_p_mask(torch.zeros(2, 5), candidates.expand(2, 5), nothing.expand(2, 5), 1.0).any()


@pytest.mark.parametrize(
    ("p", "error"),
    [(0.0, ValueError), (1.5, ValueError), (-0.1, ValueError), (math.nan, ValueError), ("0.9", TypeError)],
)
def test_bad_p(p, error):
    with pytest.raises(error, match="TopPStrategy.p must"):
        TopPStrategy(p=p)
    with pytest.raises(TypeError, match="TopPStrategy.p must be a float, got bool"):
        TopPStrategy(p=True)
