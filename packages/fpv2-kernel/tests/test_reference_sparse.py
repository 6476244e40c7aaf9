"""Sparse reference: all blocks reproduce dense, partial indexes equal explicit token masks, bad indexes refused."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fpv2.kernel import BlockIndex
from fpv2.kernel.reference import dense_attention, expand_block_mask, sparse_attention
from fpv2.kernel.testing import planted_workload

SEQLENS_Q = [37, 0, 64, 100]
SEQLENS_K = [37, 20, 128, 230]


def random_keep(seed: int, probability: float):
    """Keep the diagonal band plus each other visible block with ``probability`` (deterministic per segment)."""

    def keep(seg):
        rng = random.Random(hash((seed, seg.request, seg.kv_head, seg.tile)))
        others = [j for j in seg.kept if j not in seg.diagonal_band]
        return [*seg.diagonal_band, *(j for j in others if rng.random() < probability)]

    return keep


@pytest.mark.parametrize(("tile_size", "block_size"), [(16, 16), (32, 8), (128, 128)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_all_visible_blocks_reproduce_dense(paged_case, hand_index, group, page_size, tile_size, block_size):
    head_dim = 128 if group == 4 else 64
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size, seed=3
    )
    index, _ = hand_index(case.batch, num_kv_heads=2, group=group, tile_size=tile_size, block_size=block_size)
    dense, dense_lse = dense_attention(case.q, case.k_cache, case.v_cache, case.batch, return_lse=True)
    sparse, sparse_lse = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, return_lse=True)
    assert sparse.dtype == torch.float32 and sparse.shape == dense.shape
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sparse_lse, dense_lse, rtol=1e-5, atol=1e-5)


def test_planted_workload_all_blocks_bf16(hand_index):
    """Default 128-row tiles and 128-token blocks on a bf16 planted workload with shuffled pages."""
    w = planted_workload([300, 0, 257], [700, 40, 257], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    index, _ = hand_index(w.batch, num_kv_heads=2, group=4, tile_size=128, block_size=128)
    dense = dense_attention(w.q, w.k_cache, w.v_cache, w.batch)
    sparse = sparse_attention(w.q, w.k_cache, w.v_cache, w.batch, index)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    probability=st.floats(0.0, 1.0),
    geometry=st.sampled_from([(16, 16, 4), (8, 16, 1), (32, 8, 8), (16, 32, 2)]),
    page_size=st.sampled_from([1, 16, 64]),
)
def test_partial_index_matches_token_masked_oracle(
    paged_case, oracle, hand_index, index_token_masks, seed, probability, geometry, page_size
):
    tile_size, block_size, group = geometry
    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, page_size=page_size, seed=seed)
    index, segments = hand_index(
        case.batch,
        num_kv_heads=2,
        group=group,
        tile_size=tile_size,
        block_size=block_size,
        keep=random_keep(seed, probability),
    )
    want_out, want_lse = oracle(case, allowed=index_token_masks(case, segments, block_size))
    out, lse = sparse_attention(
        case.q, case.k_cache, case.v_cache, case.batch, index, compute_dtype=torch.float64, return_lse=True
    )
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_pruning_changes_the_output(paged_case, hand_index):
    """A partial index is not silently dense: dropping blocks moves the rows that lost them."""
    case = paged_case([64], [200], num_q_heads=4, num_kv_heads=1, page_size=16)
    full, _ = hand_index(case.batch, num_kv_heads=1, group=4, tile_size=16, block_size=16)
    pruned, _ = hand_index(
        case.batch, num_kv_heads=1, group=4, tile_size=16, block_size=16, keep=lambda seg: list(seg.diagonal_band)
    )
    a = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, full)
    b = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, pruned)
    assert (a - b).abs().amax() > 1e-2


@pytest.mark.parametrize("group", [1, 4])
def test_expand_block_mask_matches_explicit_masks(paged_case, hand_index, index_token_masks, group):
    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, page_size=16)
    index, segments = hand_index(
        case.batch, num_kv_heads=2, group=group, tile_size=16, block_size=16, keep=random_keep(7, 0.4)
    )
    kept_tokens = index_token_masks(case, segments, 16)
    for b, (q_len, kv_len, prefix) in enumerate(zip(case.seqlens_q, case.seqlens_k, case.prefix)):
        for h in range(2):
            got = expand_block_mask(index, case.batch, b, h)
            assert got.shape == (q_len * group, kv_len) and got.dtype == torch.bool
            for r in range(q_len * group):
                pos, hq = r // group, h * group + r % group
                causal = torch.arange(kv_len) <= prefix + pos
                assert torch.equal(got[r], kept_tokens(b, hq)[pos] & causal), (b, h, r)


def test_rows_without_visible_keys_are_zero_with_minus_inf_lse(paged_case, oracle, hand_index, index_token_masks):
    """A custom index that drops the diagonal band can leave rows with nothing to attend to."""
    case = paged_case([40, 30], [40, 90], num_q_heads=2, num_kv_heads=1, page_size=16)

    def keep(seg):
        if seg.request == 0 and seg.tile == 0:
            return []  # first positions of a request without prefix: nothing visible at all
        return [j for j in seg.kept if j not in seg.diagonal_band]  # earlier rows still see old blocks

    index, segments = hand_index(case.batch, num_kv_heads=1, group=2, tile_size=16, block_size=16, keep=keep)
    out, lse = sparse_attention(
        case.q, case.k_cache, case.v_cache, case.batch, index, compute_dtype=torch.float64, return_lse=True
    )
    assert torch.isneginf(lse[:8]).all() and (out[:8] == 0).all()  # tile 0 of request 0: positions 0..7
    assert torch.isfinite(lse[40:]).all()  # request 1 has a prefix of 60 tokens: blocks 0..2 stay visible
    want_out, want_lse = oracle(case, allowed=index_token_masks(case, segments, 16))
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------- refusals
def test_index_for_another_group_is_refused(paged_case, hand_index):
    case = paged_case([30, 12], [60, 12], num_q_heads=8, num_kv_heads=2, page_size=16)  # group 4
    wrong, _ = hand_index(case.batch, num_kv_heads=2, group=2, tile_size=16, block_size=16)
    with pytest.raises(ValueError, match="packed for GQA group 2, the inputs have group 4"):
        sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, wrong)


def test_index_for_another_tile_size_is_refused(paged_case, hand_index):
    case = paged_case([30, 12], [60, 12], num_q_heads=8, num_kv_heads=2, page_size=16)
    built, _ = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=16, block_size=16)
    # The same CSR relabelled as 32-row tiles: its tile offsets no longer fit the batch.
    relabelled = BlockIndex(built.offsets, built.blocks, built.tile_offsets, 2, 4, tile_size=32, block_size=16)
    with pytest.raises(ValueError, match="tile_offsets .* do not match the batch"):
        sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, relabelled)


def test_index_with_other_head_count_or_future_blocks_is_refused(paged_case, hand_index):
    case = paged_case([30, 12], [60, 12], num_q_heads=8, num_kv_heads=2, page_size=16)
    other_heads, _ = hand_index(case.batch, num_kv_heads=1, group=4, tile_size=16, block_size=16)
    with pytest.raises(ValueError, match="num_kv_heads=1, k_cache has Hkv=2"):
        sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, other_heads)
    future, _ = hand_index(
        case.batch, num_kv_heads=2, group=4, tile_size=16, block_size=16, keep=lambda seg: [*seg.kept, seg.kept[-1] + 1]
    )
    with pytest.raises(ValueError, match="beyond the causally visible blocks"):
        sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, future)
    with pytest.raises(TypeError, match="index must be a BlockIndex"):
        sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, future.to_dense_mask())


# ------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_dense_and_sparse_all_blocks_agree_on_cuda(device, hand_index):
    w = planted_workload(
        [2048, 0, 1000], [4096, 300, 1000], num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16, device=device
    )
    index, _ = hand_index(w.batch, num_kv_heads=4, group=4, tile_size=128, block_size=128)
    dense, dense_lse = dense_attention(w.q, w.k_cache, w.v_cache, w.batch, return_lse=True)
    sparse, sparse_lse = sparse_attention(w.q, w.k_cache, w.v_cache, w.batch, index, return_lse=True)
    assert dense.device.type == "cuda" and sparse.device.type == "cuda"
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sparse_lse, dense_lse, rtol=1e-4, atol=1e-4)
    # The GPU reference agrees with the CPU one on a request slice.
    cpu = dense_attention(w.q.cpu(), w.k_cache.cpu(), w.v_cache.cpu(), w.batch.to("cpu"))
    torch.testing.assert_close(dense.cpu(), cpu, rtol=1e-4, atol=1e-4)
