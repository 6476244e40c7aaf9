"""Streaming strategy (sink + window + diagonal band), the forced-block skeleton, and what every strategy shares.

``check_contract``, ``batches`` and ``configs`` are also used by the other
``test_index_strategy_*`` files.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_testlib import expected_forced, is_dense, kept_lists, make_case, tiles_of, visible_blocks

from fpv2.index import SelectionConfig, available_strategies, build_block_index, get_strategy
from fpv2.index.strategies import (
    DenseStrategy,
    MaxThresholdStrategy,
    StreamingStrategy,
    TopKStrategy,
    TopPStrategy,
    VerticalSlashStrategy,
)
from fpv2.index.strategies.streaming import select_with_forced
from fpv2.kernel.reference.fp8 import quantize_cache, quantize_queries
from fpv2.kernel.reference.pooling import pool_blocks

SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HAS_CUDA = torch.cuda.is_available()


@st.composite
def batches(draw):
    """1-3 requests with query lengths from 0 and cached prefixes (some crossing block boundaries)."""
    n = draw(st.integers(1, 3))
    seqlens_q = draw(st.lists(st.integers(0, 150), min_size=n, max_size=n))
    prefixes = draw(st.lists(st.sampled_from([0, 0, 5, 64, 130, 333]), min_size=n, max_size=n))
    if sum(seqlens_q) == 0:
        seqlens_q[0] = 1
    return seqlens_q, [q + p for q, p in zip(seqlens_q, prefixes)]


@st.composite
def configs(draw):
    """Small blocks and tiles so that tiny requests have forced, scored and dense tiles alike."""
    return SelectionConfig(
        block_size=draw(st.sampled_from([16, 32])),
        tile_size=draw(st.sampled_from([32, 64])),
        sink_tokens=draw(st.sampled_from([0, 16, 100])),
        window_tokens=draw(st.sampled_from([0, 32, 100])),
        dense_tail_tiles=draw(st.sampled_from([0, 1, 2])),
        min_sparse_kv_len=draw(st.sampled_from([0, 0, 200])),
        probe_stride=draw(st.sampled_from([1, 1, 3])),
    )


def draw_case(shape, group, page_size, cfg, seed=0):
    """A planted case with 2 KV heads for the drawn batch shape."""
    return make_case(
        *shape,
        num_q_heads=2 * group,
        num_kv_heads=2,
        head_dim=64,
        page_size=page_size,
        block_size=cfg.block_size,
        seed=seed,
    )


def check_contract(case, index, cfg):
    """The block index contract every strategy must meet: layout, causality, ascending ids, forced, dense fallbacks.

    Returns:
        Per segment: (tile, kept ids, forced ids) for further checks.
    """
    index.check_compatible(case.batch, case.group, tile_size=cfg.tile_size)
    assert (index.tile_size, index.block_size, index.group, index.num_kv_heads) == (
        cfg.tile_size,
        cfg.block_size,
        case.group,
        case.num_kv_heads,
    )
    tiles = tiles_of(case.batch, case.group, case.num_kv_heads, cfg.tile_size)
    kept = kept_lists(index)
    assert len(kept) == len(tiles)
    out = []
    for tile, ids in zip(tiles, kept):
        assert ids == sorted(set(ids)), f"{tile}: ids not strictly ascending: {ids}"
        visible = visible_blocks(tile, cfg.block_size)
        assert set(ids) <= visible, f"{tile}: keeps invisible blocks {set(ids) - visible}"
        forced = expected_forced(tile, cfg)
        assert forced <= set(ids), f"{tile}: misses forced {forced - set(ids)}"
        if is_dense(tile, cfg):
            assert set(ids) == visible, f"{tile}: dense fallback tile is not dense"
        out.append((tile, set(ids), forced))
    return out


@pytest.mark.parametrize("group", [1, 4, 8])
@SETTINGS
@given(shape=batches(), cfg=configs(), page_size=st.sampled_from([1, 16]), seed=st.integers(0, 100))
def test_streaming_is_exactly_sink_window_diagonal(group, shape, cfg, page_size, seed):
    case = draw_case(shape, group, page_size, cfg, seed)
    index = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy="streaming")
    for tile, ids, forced in check_contract(case, index, cfg):
        expected = visible_blocks(tile, cfg.block_size) if is_dense(tile, cfg) else forced
        assert ids == expected, f"{tile}: kept {sorted(ids)}, expected {sorted(expected)}"


def test_streaming_reads_no_values():
    cfg = SelectionConfig(block_size=32, tile_size=64, sink_tokens=32, window_tokens=64, min_sparse_kv_len=0)
    case = make_case([200, 70], [500, 70], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, block_size=32)
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)
    a = StreamingStrategy().select(case.q, case.batch, stats, config=cfg)
    b = StreamingStrategy().select(torch.zeros_like(case.q), case.batch, stats, config=cfg)
    assert torch.equal(a.offsets, b.offsets) and torch.equal(a.blocks, b.blocks)
    # Long requests stay sparse: the window and sink are all that is kept beyond the diagonal.
    assert a.density(case.batch) < 0.6


def test_available_strategies_lists_all_six_with_default_instances():
    assert {"dense", "max_threshold", "streaming", "top_k", "top_p", "vertical_slash"} <= set(available_strategies())
    expected = {
        "dense": DenseStrategy,
        "max_threshold": MaxThresholdStrategy,
        "streaming": StreamingStrategy,
        "top_k": TopKStrategy,
        "top_p": TopPStrategy,
        "vertical_slash": VerticalSlashStrategy,
    }
    for name, cls in expected.items():
        strategy = get_strategy(name)
        assert isinstance(strategy, cls) and strategy.name == name
    assert get_strategy("top_k") == TopKStrategy() and get_strategy("top_p") == TopPStrategy()
    assert get_strategy("vertical_slash") == VerticalSlashStrategy()
    # Instances with other parameters keep the registered name.
    assert TopKStrategy(k=3).name == "top_k" and VerticalSlashStrategy(vertical_blocks=1).name == "vertical_slash"


def test_streaming_has_no_parameters():
    with pytest.raises(TypeError):
        StreamingStrategy(256)  # sink and window come from the config


def test_extra_hook_is_merged_and_checked():
    cfg = SelectionConfig(block_size=32, tile_size=64, sink_tokens=0, window_tokens=0, min_sparse_kv_len=0)
    case = make_case([150], [400], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, block_size=32)
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)

    def block_zero_everywhere(inputs, config):
        mask = torch.zeros_like(inputs.forced)
        mask[:, 0] = True
        return mask

    index = select_with_forced(case.q, case.batch, stats, config=cfg, extra=block_zero_everywhere)
    for tile, ids, forced in check_contract(case, index, cfg):
        expected = visible_blocks(tile, 32) if is_dense(tile, cfg) else forced | {0}
        assert ids == expected

    with pytest.raises(ValueError, match=r"extra blocks of \(request 0, kv_head 0\) must be a \(\d+, 13\) bool"):
        select_with_forced(case.q, case.batch, stats, config=cfg, extra=lambda inputs, config: inputs.forced.int())
    with pytest.raises(ValueError, match="must be a"):
        select_with_forced(case.q, case.batch, stats, config=cfg, extra=lambda inputs, config: inputs.forced[:, :1])


@pytest.mark.parametrize("name", ["streaming", "top_k", "top_p", "vertical_slash"])
def test_strategies_check_their_inputs(name):
    case = make_case([100], [300], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, block_size=32)
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)
    strategy = get_strategy(name)
    with pytest.raises(ValueError, match="statistics were pooled with block_size=32"):
        strategy.select(case.q, case.batch, stats, config=SelectionConfig(block_size=64))
    with pytest.raises(ValueError, match=r"q must hold cu_seqlens_q\[-1\]=100 packed queries"):
        strategy.select(case.q[:50], case.batch, stats, config=SelectionConfig(block_size=32))
    with pytest.raises(TypeError, match="config must be a SelectionConfig"):
        strategy.select(case.q, case.batch, stats, config={"block_size": 32})


@pytest.mark.parametrize("name", ["streaming", "top_k", "top_p", "vertical_slash"])
def test_fp8_queries_select_like_their_dequantised_values(name):
    cfg = SelectionConfig(block_size=32, tile_size=64, sink_tokens=32, window_tokens=64, min_sparse_kv_len=0)
    case = make_case([150, 0, 90], [400, 30, 90], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    q8, q_descale = quantize_queries(case.q, case.batch, 2)
    k8, k_descale = quantize_cache(torch.nan_to_num(case.k_cache), case.batch)
    strategy = {"top_k": TopKStrategy(k=3), "vertical_slash": VerticalSlashStrategy(4, 2, 64)}.get(name, name)
    with pytest.raises(ValueError, match="q_descale is required for float8_e4m3fn"):
        build_block_index(q8, k8, case.batch, config=cfg, strategy=strategy)
    index8 = build_block_index(
        q8, k8, case.batch, config=cfg, strategy=strategy, q_descale=q_descale, k_descale=k_descale
    )
    per_token = q_descale.repeat_interleave(torch.tensor([150, 0, 90]), dim=0).repeat_interleave(4, dim=1)
    q_real = q8.float() * per_token[..., None]
    k_real = k8.float() * k_descale[0][None, None, :, None]
    index32 = build_block_index(q_real, k_real, case.batch, config=cfg, strategy=strategy)
    check_contract(case, index8, cfg)
    differ = [s for s, (a, b) in enumerate(zip(kept_lists(index8), kept_lists(index32))) if a != b]
    assert len(differ) <= 1, f"segments {differ} differ"  # at most a rounding tie


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["streaming", "top_k", "top_p", "vertical_slash"])
def test_gpu_matches_cpu(name):
    cfg = SelectionConfig(block_size=64, sink_tokens=64, window_tokens=128, min_sparse_kv_len=0)
    case = make_case([3000, 500], [3000, 2500], num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16)
    cpu = build_block_index(case.q, case.k_cache, case.batch, config=cfg, strategy=name)
    batch = case.batch.to("cuda")
    gpu = build_block_index(case.q.cuda(), case.k_cache.cuda(), batch, config=cfg, strategy=name)
    assert gpu.offsets.is_cuda
    differ = sum(a != b for a, b in zip(kept_lists(cpu), kept_lists(gpu)))
    # Different GEMM rounding may flip a near-tie; the index is otherwise the same.
    assert differ <= max(1, cpu.num_segments // 100), f"{differ} of {cpu.num_segments} segments differ"
