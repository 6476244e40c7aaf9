"""build_correction_plan: todo bits per segment, eligibility, kept blocks, and mismatches refused."""

from __future__ import annotations

import pytest
import torch
from correction_testlib import decode_words, make_paged, random_index
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fpv2.correction import build_correction_plan, compute_block_statistics
from fpv2.kernel import CorrectionPlan
from fpv2.kernel.contracts import tile_span
from fpv2.kernel.reference.correction_rule import todo_blocks


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqlens=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 600)), min_size=1, max_size=3),
    group=st.sampled_from([1, 4]),
    tile_size=st.sampled_from([16, 64]),
    block_size=st.sampled_from([2, 8, 32]),
    keep_prob=st.sampled_from([0.0, 0.2, 0.9]),
    keep_diagonal=st.booleans(),
    seed=st.integers(0, 100),
)
def test_todo_bits_follow_the_rule(seqlens, group, tile_size, block_size, keep_prob, keep_diagonal, seed):
    seqlens_q = [q for q, _ in seqlens]
    seqlens_k = [q + p for q, p in seqlens]
    if sum(seqlens_q) == 0:
        seqlens_q[0] += 1
        seqlens_k[0] += 1
    paged = make_paged(seqlens_q, seqlens_k, num_q_heads=2 * group, num_kv_heads=2, page_size=16, seed=seed)
    index, segs = random_index(
        paged, tile_size=tile_size, block_size=block_size, keep_prob=keep_prob, seed=seed, keep_diagonal=keep_diagonal
    )
    stats = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=block_size)
    plan = build_correction_plan(index, stats, paged.batch)
    assert isinstance(plan, CorrectionPlan) and plan.statistics is stats
    assert plan.todo_offsets.dtype == torch.int32 and plan.todo_masks.dtype == torch.int64
    assert plan.todo_offsets.shape == (index.num_segments + 1,)
    offsets, words = plan.todo_offsets.tolist(), plan.todo_masks.tolist()
    assert offsets[0] == 0 and offsets[-1] == len(words)
    for s, seg in enumerate(segs):
        seg_words = words[offsets[s] : offsets[s + 1]]
        eligible = seg.eligible(block_size)
        assert len(seg_words) == -(-eligible // 64), f"segment {s}: {len(seg_words)} words for {eligible} blocks"
        todo = decode_words(seg_words)
        # Independent rule: eligible (wholly before the first query) and not kept.
        assert todo == [j for j in range(eligible) if j not in seg.kept]
        assert not set(todo) & set(seg.kept)
        assert all(j < eligible for j in todo)
        # ... and the kernel's rule, from its own tile geometry.
        span = tile_span(
            seg.tile, paged.seqlens_q[seg.request], seg.prefix, group, tile_size=tile_size, block_size=block_size
        )
        assert todo == todo_blocks(list(seg.kept), span)


def test_sign_bit_and_multiple_words():
    # Block size 1: a tile starting at position 130 has 130 eligible blocks -> 3 words; keeping nothing sets bit 63.
    paged = make_paged([4], [134], num_q_heads=1, num_kv_heads=1, page_size=1)
    index, _ = random_index(paged, tile_size=4, block_size=1, keep_prob=0.0, seed=0, keep_diagonal=False)
    plan = build_correction_plan(
        index, compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=1), paged.batch
    )
    assert plan.todo_offsets.tolist() == [0, 3]
    assert plan.todo_masks.tolist() == [-1, -1, (1 << 2) - 1]  # 64 + 64 + 2 = 130 todo blocks


def test_mismatches_are_refused():
    paged = make_paged([30, 10], [200, 10], page_size=16)
    index, _ = random_index(paged, tile_size=16, block_size=16, keep_prob=0.5, seed=1)
    stats32 = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=32)
    with pytest.raises(ValueError, match="statistics.block_size=32 differs from the block index's block_size=16"):
        build_correction_plan(index, stats32, paged.batch)
    stats = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=16)
    no_v = type(stats)(stats.pooled_k, None, stats.block_lengths, stats.block_offsets, 16)
    with pytest.raises(ValueError, match="statistics.pooled_v is None"):
        build_correction_plan(index, no_v, paged.batch)
    other = make_paged([30, 10], [200, 60], page_size=16)
    with pytest.raises(ValueError, match="block_offsets .* do not match"):
        build_correction_plan(
            index, compute_block_statistics(other.k_cache, other.v_cache, other.batch, block_size=16), paged.batch
        )
    longer = make_paged([30, 20], [200, 20], page_size=16)  # more query tiles than the index has
    with pytest.raises(ValueError, match="tile_offsets"):
        build_correction_plan(index, stats, longer.batch)
    with pytest.raises(TypeError, match="index must be a BlockIndex"):
        build_correction_plan(None, stats, paged.batch)
    one_head = make_paged([30, 10], [200, 10], num_q_heads=2, num_kv_heads=1, page_size=16)
    with pytest.raises(ValueError, match="statistics have Hkv=1"):
        build_correction_plan(
            index,
            compute_block_statistics(one_head.k_cache, one_head.v_cache, one_head.batch, block_size=16),
            paged.batch,
        )
