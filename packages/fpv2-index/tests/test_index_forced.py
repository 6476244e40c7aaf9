"""Forced blocks and dense fallbacks: hand examples, and the tensor rule against the per-tile rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fpv2.index import SelectionConfig
from fpv2.index.reference import (
    dense_tile_count,
    dense_tile_mask,
    forced_block_mask,
    forced_blocks,
    is_dense_tile,
    request_tiles,
)
from fpv2.kernel.contracts import num_key_blocks, num_query_tiles, tile_span


def test_hand_example_sink_window_diagonal():
    # g = 1, prefix 1000, tile 0 covers positions 1000..1127. Bk = 128:
    # sink 256 tokens -> blocks {0, 1}; window 512 tokens 488..999 -> blocks {3..7}; diagonal 1000..1127 -> {7, 8}.
    span = tile_span(0, q_len=300, prefix=1000, group=1)
    assert forced_blocks(span, SelectionConfig()) == [0, 1, 3, 4, 5, 6, 7, 8]
    # Window 0: the diagonal band is still kept in full.
    assert forced_blocks(span, SelectionConfig(window_tokens=0)) == [0, 1, 7, 8]
    # A window of one token keeps only the block of token 999.
    assert forced_blocks(span, SelectionConfig(window_tokens=1, sink_tokens=0)) == [7, 8]
    # A window reaching past token 0 is clipped: blocks 0..7.
    assert forced_blocks(span, SelectionConfig(window_tokens=5000, sink_tokens=0)) == list(range(9))


def test_hand_example_causal_limit_and_first_tile():
    # Plain prefill, first tile of g = 8: positions 0..15, only block 0 is visible; sink must not exceed it.
    span = tile_span(0, q_len=4096, prefix=0, group=8)
    assert forced_blocks(span, SelectionConfig(sink_tokens=1024)) == [0]
    # Window before position 0 is empty.
    assert forced_blocks(span, SelectionConfig(sink_tokens=0, window_tokens=512)) == [0]


def test_block_size_mismatch_is_refused():
    span = tile_span(0, q_len=10, prefix=0, group=1, block_size=64)
    with pytest.raises(ValueError, match="span.block_size=64 differs from config.block_size=128"):
        forced_blocks(span, SelectionConfig())


def test_dense_fallbacks():
    cfg = SelectionConfig(dense_tail_tiles=2, min_sparse_kv_len=1000)
    assert [is_dense_tile(t, 5, 5000, cfg) for t in range(5)] == [False, False, False, True, True]
    assert all(is_dense_tile(t, 5, 999, cfg) for t in range(5))
    assert dense_tile_mask(5, 5000, cfg, "cpu").tolist() == [False, False, False, True, True]
    assert dense_tile_mask(5, 999, cfg, "cpu").all()
    assert not dense_tile_mask(5, 5000, SelectionConfig(dense_tail_tiles=0, min_sparse_kv_len=0), "cpu").any()


@pytest.mark.parametrize("dense_tail_tiles", [0, 1, 3, 9])
@pytest.mark.parametrize("kv_len", [0, 999, 1000, 5000])
@pytest.mark.parametrize("num_tiles", [0, 1, 5, 8])
def test_dense_tile_count_is_the_per_tile_rule_counted(num_tiles, kv_len, dense_tail_tiles):
    cfg = SelectionConfig(dense_tail_tiles=dense_tail_tiles, min_sparse_kv_len=1000)
    per_tile = [is_dense_tile(t, num_tiles, kv_len, cfg) for t in range(num_tiles)]
    count = dense_tile_count(num_tiles, kv_len, cfg)
    # Always a suffix: the count says which tiles, not only how many.
    assert per_tile == [t >= num_tiles - count for t in range(num_tiles)] and 0 <= count <= num_tiles
    assert dense_tile_mask(num_tiles, kv_len, cfg, "cpu").tolist() == per_tile
    expected = num_tiles if kv_len < 1000 else min(dense_tail_tiles, num_tiles)
    assert count == expected


@settings(max_examples=40, deadline=None)
@given(
    q_len=st.integers(1, 400),
    prefix=st.integers(0, 700),
    group=st.sampled_from([1, 3, 4, 8]),
    tile_size=st.sampled_from([16, 64, 128]),
    block_size=st.sampled_from([16, 32, 128]),
    sink=st.integers(0, 300),
    window=st.integers(0, 300),
)
def test_tensor_rule_equals_per_tile_rule(q_len, prefix, group, tile_size, block_size, sink, window):
    cfg = SelectionConfig(block_size=block_size, tile_size=tile_size, sink_tokens=sink, window_tokens=window)
    tiles = request_tiles(q_len, prefix, group, tile_size=tile_size, block_size=block_size)
    nb = num_key_blocks(prefix + q_len, block_size)
    mask = forced_block_mask(tiles, nb, cfg)
    assert tiles.num_tiles == num_query_tiles(q_len, group, tile_size)
    for t in range(tiles.num_tiles):
        span = tile_span(t, q_len, prefix, group, tile_size=tile_size, block_size=block_size)
        assert (int(tiles.first_pos[t]), int(tiles.last_pos[t])) == (prefix + span.p_first, prefix + span.p_last)
        expected = forced_blocks(span, cfg)
        assert torch.nonzero(mask[t]).flatten().tolist() == expected
        # The whole diagonal band is forced, and nothing past the causal limit.
        assert set(range(span.first_diagonal_block, span.last_visible_block + 1)) <= set(expected)
        assert max(expected) == span.last_visible_block


@settings(max_examples=30, deadline=None)
@given(
    q_len=st.integers(0, 300),
    prefix=st.integers(0, 500),
    group=st.sampled_from([1, 3, 4, 8]),
    tile_size=st.sampled_from([16, 128]),
    stride=st.sampled_from([1, 2, 5]),
)
def test_row_positions_follow_packgqa(q_len, prefix, group, tile_size, stride):
    tiles = request_tiles(q_len, prefix, group, tile_size=tile_size, block_size=16)
    positions = tiles.row_positions.flatten().tolist()
    rows = q_len * group
    # Packed row r is query position r // g; padding rows of the last tile are -1.
    assert positions == [prefix + r // group if r < rows else -1 for r in range(len(positions))]
    assert len(positions) == num_query_tiles(q_len, group, tile_size) * tile_size
    probed = tiles.probe_positions(stride)
    for t in range(tiles.num_tiles):
        for i in range(tile_size):
            want = tiles.row_positions[t, i] if i % stride == 0 else -1
            assert int(probed[t, i]) == int(want)
