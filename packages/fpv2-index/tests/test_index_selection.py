"""Selection properties over a grid of GQA ratios, page sizes, head dims and varlen batches with prefixes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_testlib import (
    expected_forced,
    is_dense,
    kept_lists,
    make_case,
    oracle_energies,
    oracle_pooled,
    oracle_selection,
    tiles_of,
    visible_blocks,
)

from fpv2.index import SelectionConfig, build_block_index
from fpv2.index.reference import block_energies, request_tiles, select_blocks, tile_rows
from fpv2.kernel.reference.pooling import pool_blocks

SETTINGS = settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GRID = pytest.mark.parametrize(
    ("group", "page_size", "head_dim"),
    [(g, p, d) for g in (1, 4, 8) for p in (1, 16, 64) for d in (64, 128)],
)


@st.composite
def batches(draw):
    """1-3 requests; query lengths from 0, prefixes from 0 (a zero-length request may have no KV at all)."""
    n = draw(st.integers(1, 3))
    seqlens_q = draw(st.lists(st.integers(0, 120), min_size=n, max_size=n))
    prefixes = draw(st.lists(st.sampled_from([0, 0, 5, 64, 130, 333]), min_size=n, max_size=n))
    if sum(seqlens_q) == 0:
        seqlens_q[0] = 1
    return seqlens_q, [q + p for q, p in zip(seqlens_q, prefixes)]


@st.composite
def configs(draw):
    return SelectionConfig(
        alpha=draw(st.sampled_from([0.02, 0.1, 0.3, 0.7])),
        block_size=draw(st.sampled_from([16, 64])),
        tile_size=draw(st.sampled_from([32, 128])),
        sink_tokens=draw(st.sampled_from([0, 16, 100])),
        window_tokens=draw(st.sampled_from([0, 32, 200])),
        dense_tail_tiles=draw(st.sampled_from([0, 1, 2])),
        min_sparse_kv_len=draw(st.sampled_from([0, 0, 200])),
        probe_stride=draw(st.sampled_from([1, 1, 3])),
    )


def check_index_properties(case, index, cfg):
    """Causality, forced blocks, dense fallbacks, ascending ids, contract compatibility."""
    index.check_compatible(case.batch, case.group, tile_size=cfg.tile_size)
    assert (index.tile_size, index.block_size, index.group) == (cfg.tile_size, cfg.block_size, case.group)
    tiles = tiles_of(case.batch, case.group, case.num_kv_heads, cfg.tile_size)
    kept = kept_lists(index)
    assert len(kept) == len(tiles)
    for tile, ids in zip(tiles, kept):
        assert ids == sorted(set(ids)), f"{tile}: ids not strictly ascending: {ids}"
        visible = visible_blocks(tile, cfg.block_size)
        assert set(ids) <= visible, f"{tile}: keeps invisible blocks {set(ids) - visible}"
        assert expected_forced(tile, cfg) <= set(ids), f"{tile}: misses forced {expected_forced(tile, cfg) - set(ids)}"
        if is_dense(tile, cfg):
            assert set(ids) == visible, f"{tile}: dense fallback tile is not dense"


@GRID
@SETTINGS
@given(shape=batches(), cfg=configs(), seed=st.integers(0, 1000))
def test_selection_properties_and_oracle(group, page_size, head_dim, shape, cfg, seed):
    seqlens_q, seqlens_k = shape
    case = make_case(
        seqlens_q,
        seqlens_k,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=head_dim,
        page_size=page_size,
        block_size=cfg.block_size,
        seed=seed,
    )
    index = build_block_index(case.q, case.k_cache, case.batch, config=cfg)
    check_index_properties(case, index, cfg)
    # Same kept sets as the float64 oracle, except blocks within rounding of the threshold.
    for s, (ids, (expected, unsure)) in enumerate(zip(kept_lists(index), oracle_selection(case, cfg))):
        assert set(ids) - unsure == expected - unsure, f"segment {s}: got {ids}, oracle {sorted(expected)}"
    # The dense strategy keeps exactly the visible blocks.
    dense = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy="dense")
    check_index_properties(case, dense, cfg)
    tiles = tiles_of(case.batch, case.group, case.num_kv_heads, cfg.tile_size)
    assert [set(ids) for ids in kept_lists(dense)] == [visible_blocks(t, cfg.block_size) for t in tiles]
    assert dense.density(case.batch) == 1.0


@pytest.mark.parametrize("group", [1, 4, 8])
@SETTINGS
@given(shape=batches(), cfg=configs(), alphas=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=2, unique=True))
def test_larger_alpha_keeps_a_subset(group, shape, cfg, alphas):
    case = make_case(
        *shape, num_q_heads=2 * group, num_kv_heads=2, head_dim=64, page_size=16, block_size=cfg.block_size
    )
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=cfg.block_size)
    low, high = sorted(alphas)
    kw = {k: getattr(cfg, k) for k in ("block_size", "tile_size", "sink_tokens", "window_tokens", "probe_stride")}
    kw.update(dense_tail_tiles=0, min_sparse_kv_len=0)
    loose = build_block_index(
        case.q, case.k_cache, case.batch, config=SelectionConfig(alpha=low, **kw), statistics=stats
    )
    tight = build_block_index(
        case.q, case.k_cache, case.batch, config=SelectionConfig(alpha=high, **kw), statistics=stats
    )
    for a, b in zip(kept_lists(tight), kept_lists(loose)):
        assert set(a) <= set(b)
    assert tight.nnz <= loose.nnz


@pytest.mark.parametrize("group", [1, 4])
def test_online_scoring_selects_the_same_blocks(group):
    case = make_case(
        [300, 0, 170], [700, 40, 170], num_q_heads=2 * group, num_kv_heads=2, head_dim=64, page_size=16, block_size=32
    )
    cfg = SelectionConfig(block_size=32, tile_size=64, sink_tokens=32, window_tokens=64, min_sparse_kv_len=0)
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)
    direct = select_blocks(case.q, case.batch, stats, config=cfg)
    online = select_blocks(case.q, case.batch, stats, config=cfg, online=True)
    assert torch.equal(direct.offsets, online.offsets) and torch.equal(direct.blocks, online.blocks)
    assert direct.density(case.batch) < 0.9  # the example does prune


def test_page_layout_does_not_change_the_index():
    """The same tokens behind page sizes 1, 16 and 64 (different page permutations) give the same index."""
    cfg = SelectionConfig(block_size=64, sink_tokens=64, window_tokens=64, min_sparse_kv_len=0, alpha=0.2)
    indexes = []
    for page_size in (1, 16, 64):
        case = make_case(
            [200, 90], [500, 90], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size, block_size=64, seed=7
        )
        indexes.append(build_block_index(case.q, case.k_cache, case.batch, config=cfg))
    for other in indexes[1:]:
        assert torch.equal(other.offsets, indexes[0].offsets) and torch.equal(other.blocks, indexes[0].blocks)
    assert indexes[0].density(case.batch) < 1.0


def test_dense_strategy_skips_the_host_copy_of_its_ids(monkeypatch):
    """The dense index is correct by construction: it is built without BlockIndex.validate_values (which copies
    every id to the host; 16.8M ids at 128K) and still passes that check, and the kept sets are the visible blocks."""
    from fpv2.kernel.contracts import BlockIndex

    cfg = SelectionConfig(block_size=64, sink_tokens=64, window_tokens=64, min_sparse_kv_len=0)
    case = make_case(
        [300, 0, 70, 129], [300, 40, 700, 129], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
        block_size=64, seed=3,
    )  # fmt: skip
    checked = BlockIndex.validate_values

    def refuse(index):
        raise AssertionError("the dense strategy copied its ids to the host")

    monkeypatch.setattr(BlockIndex, "validate_values", refuse)
    dense = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy="dense")
    checked(dense)
    tiles = tiles_of(case.batch, case.group, case.num_kv_heads, cfg.tile_size)
    assert [set(ids) for ids in kept_lists(dense)] == [visible_blocks(t, cfg.block_size) for t in tiles]


def test_probe_stride_scores_with_a_subset_of_rows():
    # Stride larger than the tile: only each tile's first row scores. Compare with the oracle, which probes alike.
    case = make_case([256], [900], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, block_size=32)
    base = dict(block_size=32, tile_size=64, sink_tokens=0, window_tokens=0, min_sparse_kv_len=0, alpha=0.3)
    for stride in (1, 7, 64):
        cfg = SelectionConfig(probe_stride=stride, **base)
        index = build_block_index(case.q, case.k_cache, case.batch, config=cfg)
        for ids, (expected, unsure) in zip(kept_lists(index), oracle_selection(case, cfg)):
            assert set(ids) - unsure == expected - unsure


@pytest.mark.parametrize(("group", "stride"), [(1, 1), (4, 1), (8, 3)])
def test_request_energies_match_the_oracle(group, stride):
    """Energies of every tile from the tensor layout (tiles, rows, pooled keys) equal the per-tile float64 oracle."""
    case = make_case([90], [200], num_q_heads=2 * group, num_kv_heads=2, head_dim=64, page_size=16, block_size=4)
    cfg = SelectionConfig(block_size=4, tile_size=16, probe_stride=stride, min_sparse_kv_len=0)
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=4)
    tiles = request_tiles(90, 110, group, tile_size=16, block_size=4)
    scale = 1 / 8
    for h in range(2):
        energies, _ = block_energies(
            tile_rows(case.q, group, h, 16),
            tiles.probe_positions(stride),
            tiles.num_scored_blocks,
            stats.pooled_k[:, h],
            scale=scale,
            block_size=4,
        )
        pooled = oracle_pooled(case, 0, h, 4)
        for tile in [t for t in tiles_of(case.batch, group, 2, 16) if t.kv_head == h]:
            expected = oracle_energies(case, tile, cfg, scale, pooled)
            got = energies[tile.tile, : expected.numel()].double()
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-9)
            assert not energies[tile.tile, expected.numel() :].any()  # non-candidates carry no energy
