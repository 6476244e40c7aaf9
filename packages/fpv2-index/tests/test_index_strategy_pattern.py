"""Vertical-slash strategy: contract, parameters, planted verticals and slashes recovered, pieces vs oracles."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from index_testlib import expected_forced, is_dense, kept_lists, make_case, oracle_pooled, tiles_of, visible_blocks
from test_index_strategy_streaming import SETTINGS, batches, check_contract, configs, draw_case

from fpv2.index import SelectionConfig, build_block_index, get_strategy
from fpv2.index.strategies import VerticalSlashStrategy
from fpv2.index.strategies.streaming import select_with_forced
from fpv2.index.strategies.vertical_slash import query_block_attention, slash_block_mask
from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.reference.pooling import pool_blocks
from fpv2.kernel.testing import planted_workload


def record_patterns(strategy, case_q, batch, k_cache, cfg):
    """Run the strategy through the forced skeleton and record (inputs, verticals, slashes) of every (request, head)."""
    stats = pool_blocks(k_cache, None, batch, block_size=cfg.block_size)
    seen = []

    def hook(inputs, config):
        verticals, slashes = strategy.pattern(inputs, config)
        seen.append((inputs, verticals, slashes))
        return strategy.extra_blocks(inputs, config)

    index = select_with_forced(case_q, batch, stats, config=cfg, extra=hook)
    return index, seen


@pytest.mark.parametrize("group", [1, 4, 8])
@SETTINGS
@given(
    shape=batches(),
    cfg=configs(),
    page_size=st.sampled_from([1, 16]),
    budgets=st.tuples(st.integers(0, 4), st.integers(0, 4), st.sampled_from([1, 20, 100, 1000])),
    seed=st.integers(0, 100),
)
def test_contract_and_budgets(group, shape, cfg, page_size, budgets, seed):
    vertical, slash, last = budgets
    if vertical == slash == 0:
        vertical = 1
    case = draw_case(shape, group, page_size, cfg, seed)
    strategy = VerticalSlashStrategy(vertical_blocks=vertical, slash_blocks=slash, last_queries=last)
    index, seen = record_patterns(strategy, case.q, case.batch, case.k_cache, cfg)
    segments = check_contract(case, index, cfg)
    assert index.nnz == build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy=strategy).nnz
    patterns = {(inputs.request, inputs.kv_head): (v, s) for inputs, v, s in seen}
    window_offsets = cfg.window_tokens // cfg.block_size
    for tile, ids, forced in segments:
        if is_dense(tile, cfg):
            continue
        verticals, slashes = patterns[(tile.request, tile.kv_head)]
        assert int(verticals.sum()) <= vertical and int(slashes.sum()) <= slash
        chosen_v = set(torch.nonzero(verticals).flatten().tolist())
        chosen_s = set(torch.nonzero(slashes).flatten().tolist())
        assert all(j * cfg.block_size >= cfg.sink_tokens for j in chosen_v)  # the sink is forced, not budgeted
        assert all(o > window_offsets for o in chosen_s)  # offsets the window and diagonal cover are not budgeted
        # Kept = forced + visible verticals + blocks on the slashes through the tile's query blocks, nothing else.
        first_q, last_q = tile.first // cfg.block_size, tile.last // cfg.block_size
        on_slash = {q - o for o in chosen_s for q in range(first_q, last_q + 1) if q - o >= 0}
        expected = forced | ((chosen_v | on_slash) & visible_blocks(tile, cfg.block_size))
        assert ids == expected, f"{tile}: kept {sorted(ids)}, expected {sorted(expected)}"


def test_planted_verticals_are_recovered_at_low_density():
    w = planted_workload(
        [8192],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        fraction=0.03,
        block_size=64,
        seed=11,
        dtype=torch.float32,
    )
    cfg = SelectionConfig(block_size=64, sink_tokens=64, window_tokens=128, min_sparse_kv_len=0)
    planted_count = int(w.planted_blocks[0].sum(dim=1).max())
    strategy = VerticalSlashStrategy(vertical_blocks=planted_count, slash_blocks=1, last_queries=256)
    index, seen = record_patterns(strategy, w.q, w.batch, w.k_cache, cfg)
    # The estimate itself names the planted blocks (outside the sink, which is forced anyway).
    for inputs, verticals, _ in seen:
        planted = w.planted_blocks[0][inputs.kv_head].clone()
        planted[0] = False  # block 0 is the sink
        assert torch.equal(verticals & planted, planted), f"head {inputs.kv_head}: {verticals.nonzero().flatten()}"
    found = pairs = 0
    for tile, ids in zip(tiles_of(w.batch, 4, 2, cfg.tile_size), kept_lists(index)):
        if is_dense(tile, cfg):
            continue
        planted = set(torch.nonzero(w.planted_blocks[0][tile.kv_head]).flatten().tolist())
        free = visible_blocks(tile, cfg.block_size) - expected_forced(tile, cfg)
        pairs += len(planted & free)
        found += len(planted & free & set(ids))
    assert pairs > 500
    assert found / pairs >= 0.9, f"recall {found}/{pairs}"
    density = index.density(w.batch)
    streaming = build_block_index(w.q, w.k_cache, w.batch, config=cfg, strategy="streaming").density(w.batch)
    assert density < 0.15, f"density {density:.3f}"
    # Budgeted blocks add at most (verticals + 2 blocks per slash) per tile over the forced ones.
    assert density - streaming < (planted_count + 2) / 64, f"density {density:.3f} vs streaming {streaming:.3f}"


def slash_workload(offset, *, vertical=None, kv_len=2048, block_size=64, group=2, head_dim=64, margin=7.0, seed=0):
    """One KV head whose query block ``Q`` attends key block ``Q - offset`` (a slash at block level).

    With ``vertical``, every query also attends that key block, more strongly than its slash block.
    """
    gen = torch.Generator().manual_seed(seed)
    nb = kv_len // block_size
    directions = torch.randn(nb + 1, head_dim, generator=gen)
    directions /= directions.norm(dim=1, keepdim=True)
    amp = math.sqrt(margin * math.sqrt(head_dim))
    pos = torch.arange(kv_len)
    keys = torch.randn(kv_len, head_dim, generator=gen) + amp * directions[pos // block_size]
    q = torch.randn(kv_len, group, head_dim, generator=gen)
    target = pos // block_size - offset
    q[target >= 0] += amp * directions[target[target >= 0]][:, None, :]
    if vertical is not None:
        keys[pos // block_size == vertical] += 1.5 * amp * directions[nb]
        q += 1.5 * amp * directions[nb]
    batch = PagedPrefillBatch.contiguous([kv_len], [kv_len], page_size=1)
    return q, keys[:, None, None, :].contiguous(), batch


@pytest.mark.parametrize("vertical", [None, 9])
def test_planted_slash_is_recovered(vertical):
    offset, bk = 6, 64
    q, k_cache, batch = slash_workload(offset, vertical=vertical, block_size=bk)
    cfg = SelectionConfig(block_size=bk, sink_tokens=64, window_tokens=64, min_sparse_kv_len=0)
    strategy = VerticalSlashStrategy(vertical_blocks=1 if vertical else 2, slash_blocks=1, last_queries=256)
    index, seen = record_patterns(strategy, q, batch, k_cache, cfg)
    ((_, verticals, slashes),) = seen
    # A strong column is a vertical; taken out of the slash scores, it cannot pose as a slash at Q - vertical.
    if vertical is not None:
        assert torch.nonzero(verticals).flatten().tolist() == [vertical]
    assert torch.nonzero(slashes).flatten().tolist() == [offset]
    checked = 0
    for tile, ids in zip(tiles_of(batch, 2, 1, cfg.tile_size), kept_lists(index)):
        wanted = {qb - offset for qb in range(tile.first // bk, tile.last // bk + 1) if qb - offset >= 0}
        assert wanted <= set(ids), f"{tile}: misses slash blocks {wanted - set(ids)}"
        checked += len(wanted)
    assert checked > 20
    assert index.density(batch) < 0.35


def test_query_block_attention_matches_a_float64_oracle():
    bk, group = 32, 2
    case = make_case([100], [300], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, block_size=bk, seed=4)
    cfg = SelectionConfig(block_size=bk, tile_size=64, sink_tokens=0, window_tokens=0, min_sparse_kv_len=0)
    last = 70
    _, seen = record_patterns(VerticalSlashStrategy(last_queries=last), case.q, case.batch, case.k_cache, cfg)
    scale = 1 / math.sqrt(64)
    for inputs, _, _ in seen:
        shares, first = query_block_attention(inputs, last, bk)
        pooled = oracle_pooled(case, 0, inputs.kv_head, bk)
        expected = torch.zeros(shares.shape, dtype=torch.float64)
        for i in range(100 - last, 100):
            position = 200 + i  # the prefix is 200 tokens
            for head in range(inputs.kv_head * group, (inputs.kv_head + 1) * group):
                row = case.q[i, head].double()
                weights = torch.tensor(
                    [
                        min(bk, position - j * bk + 1) * math.exp(float(row @ pooled[j]) * scale)
                        for j in range(position // bk + 1)
                    ],
                    dtype=torch.float64,
                )
                expected[position // bk - first, : weights.numel()] += weights / weights.sum()
        assert first == (200 + 100 - last) // bk
        torch.testing.assert_close(shares.double(), expected, rtol=1e-4, atol=1e-6)
        assert math.isclose(float(shares.sum()), last * group, rel_tol=1e-5)  # every row's shares sum to 1


@SETTINGS
@given(
    nb=st.integers(1, 40),
    data=st.data(),
)
def test_slash_block_mask_matches_brute_force(nb, data):
    slashes = torch.tensor(data.draw(st.lists(st.booleans(), min_size=nb, max_size=nb)))
    tiles = data.draw(st.lists(st.tuples(st.integers(0, nb - 1), st.integers(0, 3)), min_size=1, max_size=6))
    first = torch.tensor([a for a, _ in tiles])
    last = torch.tensor([min(a + span, nb - 1) for a, span in tiles])
    got = slash_block_mask(slashes, first, last)
    chosen = [o for o in range(nb) if slashes[o]]
    for t, (a, z) in enumerate(zip(first.tolist(), last.tolist())):
        expected = [any(0 <= q - o == j for o in chosen for q in range(a, z + 1)) for j in range(nb)]
        assert got[t].tolist() == expected


def test_registered_default_and_pipeline_api():
    cfg = SelectionConfig(block_size=32, tile_size=64, sink_tokens=32, window_tokens=64, min_sparse_kv_len=0)
    case = make_case([300], [900], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, block_size=32)
    by_name = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy="vertical_slash")
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)
    direct = VerticalSlashStrategy().select(case.q, case.batch, stats, config=cfg)
    assert torch.equal(by_name.offsets, direct.offsets) and torch.equal(by_name.blocks, direct.blocks)
    assert get_strategy("vertical_slash") == VerticalSlashStrategy(vertical_blocks=32, slash_blocks=8, last_queries=512)
    check_contract(case, by_name, cfg)
    small = build_block_index(
        case.q, case.k_cache, case.batch, config=cfg, strategy=VerticalSlashStrategy(vertical_blocks=1, slash_blocks=0)
    )
    assert small.nnz < by_name.nnz


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"vertical_blocks": -1}, ValueError, "vertical_blocks must be >= 0, got -1"),
        ({"slash_blocks": -2}, ValueError, "slash_blocks must be >= 0, got -2"),
        ({"last_queries": 0}, ValueError, "last_queries must be >= 1, got 0"),
        ({"vertical_blocks": 0, "slash_blocks": 0}, ValueError, "needs vertical_blocks > 0 or slash_blocks > 0"),
        ({"vertical_blocks": 2.5}, TypeError, "vertical_blocks must be an int, got float 2.5"),
        ({"slash_blocks": True}, TypeError, "slash_blocks must be an int, got bool"),
        ({"last_queries": "64"}, TypeError, "last_queries must be an int, got str"),
    ],
)
def test_bad_parameters(kwargs, error, message):
    with pytest.raises(error, match=f"VerticalSlashStrategy.*{message}"):
        VerticalSlashStrategy(**kwargs)
