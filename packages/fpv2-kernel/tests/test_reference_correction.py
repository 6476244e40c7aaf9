"""Mean correction in the sparse reference: explicit pooled columns, todo bitmasks, and exactness on flat blocks."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fpv2.kernel import BlockStatistics, CorrectionPlan
from fpv2.kernel.reference import dense_attention, pool_blocks, sparse_attention

SEQLENS_Q = [37, 0, 64, 100]
SEQLENS_K = [37, 20, 128, 300]


def random_keep(seed: int, probability: float):
    """Keep the diagonal band plus each other visible block with ``probability``."""

    def keep(seg):
        rng = random.Random(hash((seed, seg.request, seg.kv_head, seg.tile)))
        return [*seg.diagonal_band, *(j for j in seg.kept if j not in seg.diagonal_band and rng.random() < probability)]

    return keep


def rule_todo(seg) -> list[int]:
    """Eligible (wholly before the tile's first query) and not kept, written out in the test."""
    return [j for j in range(seg.num_eligible) if j not in seg.kept]


def pooled_columns(case, segments, block_size, todo_of=rule_todo, scale=None):
    """``(b, hq) -> (logits, values)`` extra columns: every block of the request, ``-inf`` unless todo for the row.

    Pooled keys/values are block means computed here in fp64 from the contiguous K/V.
    """
    d = case.q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = case.group
    q = case.q.double().cpu()
    columns = {}
    for b, (q_len, kv_len, start) in enumerate(zip(case.seqlens_q, case.seqlens_k, case.starts)):
        nblocks = -(-kv_len // block_size)
        lengths = torch.tensor([min(block_size, kv_len - j * block_size) for j in range(nblocks)], dtype=torch.float64)
        pk = torch.stack([case.keys[b][j * block_size : (j + 1) * block_size].double().mean(0) for j in range(nblocks)])
        pv = torch.stack(
            [case.values[b][j * block_size : (j + 1) * block_size].double().mean(0) for j in range(nblocks)]
        )
        for hq in range(case.q.shape[1]):
            columns[(b, hq)] = [torch.full((q_len, nblocks), -math.inf, dtype=torch.float64), pv[:, hq // g]]
        for seg in (s for s in segments if s.request == b):
            todo = todo_of(seg)
            if not todo:
                continue
            for r in range(seg.row_begin, seg.row_end):
                pos, hq = r // g, seg.kv_head * g + r % g
                # |B_J| tokens stood in for by their mean: logit shifted by log |B_J|.
                logits = (pk[todo, seg.kv_head] @ q[start + pos, hq]) * scale + torch.log(lengths[todo])
                columns[(b, hq)][0][pos, todo] = logits
    return lambda b, hq: tuple(columns[(b, hq)])


def signed_words(todo: list[int], eligible: int) -> list[int]:
    """Pack block ids into 64-bit words as signed ints (bit j % 64 of word j // 64)."""
    words = [0] * (-(-eligible // 64))
    for j in todo:
        words[j // 64] |= 1 << (j % 64)
    return [w - (1 << 64) if w >= 1 << 63 else w for w in words]


def explicit_plan(stats, segments, todo_of) -> CorrectionPlan:
    """A plan carrying explicit todo words for every segment."""
    offsets, words = [0], []
    for seg in segments:
        words.extend(signed_words(todo_of(seg), seg.num_eligible))
        offsets.append(len(words))
    device = stats.pooled_k.device
    return CorrectionPlan(
        stats,
        todo_offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
        todo_masks=torch.tensor(words, dtype=torch.int64, device=device),
    )


@pytest.mark.parametrize(("tile_size", "block_size", "group"), [(16, 16, 1), (16, 8, 4), (32, 16, 8), (16, 4, 2)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_correction_equals_appended_pooled_columns(
    paged_case, oracle, hand_index, index_token_masks, tile_size, block_size, group, page_size
):
    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, page_size=page_size, seed=group)
    index, segments = hand_index(
        case.batch, num_kv_heads=2, group=group, tile_size=tile_size, block_size=block_size, keep=random_keep(1, 0.3)
    )
    assert any(rule_todo(seg) for seg in segments)
    plan = CorrectionPlan(pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=block_size))
    out, lse = sparse_attention(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, compute_dtype=torch.float64, return_lse=True
    )
    want_out, want_lse = oracle(
        case,
        allowed=index_token_masks(case, segments, block_size),
        extra=pooled_columns(case, segments, block_size),
    )
    # The plan's pooled statistics are fp32 (as the kernel reads them): fp32-level agreement.
    torch.testing.assert_close(out, want_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-6, atol=2e-6)
    uncorrected = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, compute_dtype=torch.float64)
    assert (uncorrected - out).abs().amax() > 1e-3


def test_explicit_todo_words_are_honoured(paged_case, oracle, hand_index, index_token_masks):
    """Bits of plan.todo_masks decide which pooled columns are added, over several words and the sign bit."""
    case = paged_case([40, 16], [340, 16], num_q_heads=4, num_kv_heads=2, page_size=16, seed=5)
    block_size = 4  # 85 blocks: two todo words per early tile
    index, segments = hand_index(
        case.batch, num_kv_heads=2, group=2, tile_size=16, block_size=block_size, keep=random_keep(2, 0.2)
    )
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=block_size)

    def subset(seg):
        return [j for j in rule_todo(seg) if j % 3 != 1 or j == 63]

    assert any(63 in subset(seg) for seg in segments)  # the sign bit of word 0 is exercised
    plan = explicit_plan(stats, segments, subset)
    got = sparse_attention(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, compute_dtype=torch.float64
    )
    want, _ = oracle(
        case, allowed=index_token_masks(case, segments, block_size), extra=pooled_columns(case, segments, 4, subset)
    )
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)

    # Words equal to the rule give the same result as letting the reference derive them.
    by_words = sparse_attention(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=explicit_plan(stats, segments, rule_todo)
    )
    by_rule = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(stats))
    torch.testing.assert_close(by_words, by_rule, rtol=0, atol=0)
    assert (by_rule.double() - got).abs().amax() > 1e-4  # the subset really differs


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    probability=st.floats(0.0, 0.9),
    geometry=st.sampled_from([(16, 16, 4), (8, 8, 1), (32, 16, 8), (16, 32, 2)]),
    page_size=st.sampled_from([1, 16, 64]),
)
def test_correction_is_exact_on_block_constant_kv(paged_case, hand_index, seed, probability, geometry, page_size):
    """With K and V constant inside every block, a pooled pair *is* its block: pruned + corrected == dense."""
    tile_size, block_size, group = geometry
    case = paged_case(
        SEQLENS_Q,
        SEQLENS_K,
        num_q_heads=2 * group,
        num_kv_heads=2,
        page_size=page_size,
        seed=seed,
        constant_blocks=block_size,
    )
    index, segments = hand_index(
        case.batch,
        num_kv_heads=2,
        group=group,
        tile_size=tile_size,
        block_size=block_size,
        keep=random_keep(seed, probability),
    )
    plan = CorrectionPlan(pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=block_size))
    args = (case.q, case.k_cache, case.v_cache, case.batch)
    dense, dense_lse = dense_attention(*args, compute_dtype=torch.float64, return_lse=True)
    corrected, lse = sparse_attention(*args, index, plan=plan, compute_dtype=torch.float64, return_lse=True)
    torch.testing.assert_close(corrected, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, dense_lse, rtol=1e-5, atol=1e-5)
    if any(rule_todo(seg) for seg in segments):
        dropped = sparse_attention(*args, index, compute_dtype=torch.float64)
        assert (dropped - dense).abs().amax() > 1e-3


# ------------------------------------------------------------------- refusals
def test_plan_that_does_not_fit_is_refused(paged_case, hand_index):
    case = paged_case([30, 12], [90, 12], num_q_heads=4, num_kv_heads=2, page_size=16)
    index, segments = hand_index(
        case.batch, num_kv_heads=2, group=2, tile_size=16, block_size=16, keep=random_keep(0, 0.5)
    )
    args = (case.q, case.k_cache, case.v_cache, case.batch, index)
    stats8 = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=8)
    with pytest.raises(ValueError, match="block_size=8, the block index block_size=16"):
        sparse_attention(*args, plan=CorrectionPlan(stats8))

    stats = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=16)
    shifted = BlockStatistics(
        stats.pooled_k, stats.pooled_v, stats.block_lengths, torch.tensor([0, 1, 7], dtype=torch.int32), 16
    )
    with pytest.raises(ValueError, match=r"hold \[1, 6\] blocks per request .* needs \[6, 1\]"):
        sparse_attention(*args, plan=CorrectionPlan(shifted))

    def with_kept_block(seg):
        return sorted(set(rule_todo(seg)) | {j for j in seg.kept if j < seg.num_eligible})

    assert any(j < seg.num_eligible for seg in segments for j in seg.kept)
    with pytest.raises(ValueError, match="marks block .* as todo"):
        sparse_attention(*args, plan=explicit_plan(stats, segments, with_kept_block))

    short = explicit_plan(stats, segments, rule_todo)
    short = CorrectionPlan(stats, todo_offsets=short.todo_offsets[:-1].contiguous(), todo_masks=short.todo_masks)
    with pytest.raises(ValueError, match="todo_offsets must have num_segments"):
        sparse_attention(*args, plan=short)
