"""The dense reference equals an independent fp64 computation on paged, varlen, prefixed batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fpv2.kernel.reference import attention as attention_module
from fpv2.kernel.reference import dense_attention

# Varlen batch with prefixes: a plain request (q_len == kv_len), a zero-length request
# on top of a cached prefix, an exact multiple of the page sizes, and a long prefix.
SEQLENS_Q = [37, 0, 64, 100]
SEQLENS_K = [37, 20, 128, 230]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_dense_matches_naive_fp64_and_fp32(paged_case, oracle, group, page_size, head_dim):
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size, seed=group
    )
    want_out, want_lse = oracle(case)

    out64, lse64 = dense_attention(
        case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64, return_lse=True
    )
    assert out64.dtype == torch.float64 and out64.shape == (sum(SEQLENS_Q), 2 * group, head_dim)
    assert lse64.dtype == torch.float32 and lse64.shape == (sum(SEQLENS_Q), 2 * group)
    torch.testing.assert_close(out64.cpu(), want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse64.double().cpu(), want_lse, rtol=1e-6, atol=1e-6)  # lse is stored as fp32

    out32, lse32 = dense_attention(case.q, case.k_cache, case.v_cache, case.batch, return_lse=True)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double().cpu(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse32.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 40)), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_dense_random_batches(paged_case, oracle, lengths, page_size, group, seed):
    seqlens_q = [q for q, _ in lengths]
    seqlens_k = [q + p for q, p in lengths]
    if max(seqlens_k) == 0:
        seqlens_k[0] = 1  # a cache needs at least one token
    case = paged_case(seqlens_q, seqlens_k, num_q_heads=group, num_kv_heads=1, page_size=page_size, seed=seed)
    want_out, want_lse = oracle(case)
    out, lse = dense_attention(
        case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64, return_lse=True
    )
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_query_chunks_do_not_change_the_result(paged_case, monkeypatch):
    """Chunk boundaries that split a GQA group or a page give the same rows."""
    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=16)
    whole = dense_attention(case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64)
    monkeypatch.setattr(attention_module, "QUERY_CHUNK_ROWS", 7)  # 7 // 4 = 1 position per chunk
    chunked = dense_attention(case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64)
    torch.testing.assert_close(chunked, whole, rtol=1e-13, atol=1e-13)


def test_custom_softmax_scale(paged_case, oracle):
    case = paged_case([20, 9], [50, 9], num_q_heads=4, num_kv_heads=2, page_size=4)
    want, _ = oracle(case, scale=0.3)
    got = dense_attention(
        case.q, case.k_cache, case.v_cache, case.batch, softmax_scale=0.3, compute_dtype=torch.float64
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    default = dense_attention(case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64)
    assert (got - default).abs().max() > 1e-3  # the scale is really used


def test_bf16_inputs_are_upcast_exactly(paged_case, oracle):
    case = paged_case([33, 0, 16], [70, 5, 16], num_q_heads=8, num_kv_heads=2, page_size=16, dtype=torch.bfloat16)
    want, _ = oracle(case)  # oracle reads the bf16 values, rounded exactly to fp64
    got = dense_attention(case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_first_query_without_prefix_copies_its_value(paged_case):
    """Query 0 of a request without prefix sees exactly one key: its output is that value, lse its logit."""
    case = paged_case([5], [5], num_q_heads=2, num_kv_heads=1, page_size=1)
    out, lse = dense_attention(
        case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64, return_lse=True
    )
    torch.testing.assert_close(out[0, 0].float(), case.values[0][0, 0])
    logit = float(case.q[0, 0].double() @ case.keys[0][0, 0].double()) / math.sqrt(64)
    assert lse[0, 0].item() == pytest.approx(logit, rel=1e-6)


def test_zero_length_requests_give_no_rows(paged_case):
    case = paged_case([0, 3, 0], [4, 3, 9], num_q_heads=2, num_kv_heads=1, page_size=4)
    out = dense_attention(case.q, case.k_cache, case.v_cache, case.batch)
    assert out.shape == (3, 2, 64) and torch.isfinite(out).all()


def test_bad_arguments_are_named(paged_case):
    case = paged_case([4], [4], num_q_heads=2, num_kv_heads=1, page_size=4)
    args = (case.q, case.k_cache, case.v_cache, case.batch)
    with pytest.raises(TypeError, match="compute_dtype"):
        dense_attention(*args, compute_dtype=torch.float16)
    with pytest.raises(ValueError, match="softmax_scale"):
        dense_attention(*args, softmax_scale=-1.0)
    with pytest.raises(TypeError, match="softmax_scale"):
        dense_attention(*args, softmax_scale="0.1")
    with pytest.raises(ValueError, match="q_descale is only meaningful"):
        dense_attention(*args, q_descale=torch.ones(1, 1))
    with pytest.raises(ValueError, match="q must hold"):
        dense_attention(case.q[:3], case.k_cache, case.v_cache, case.batch)
