"""FP8 (e4m3) conventions: per-group scales, rounding error bounds, probability rounding, FP8 attention."""

from __future__ import annotations

import math

import pytest
import torch

from fpv2.kernel.reference import (
    FP8_E4M3_MAX,
    dense_attention,
    dequantize_cache,
    dequantize_queries,
    quantize_cache,
    quantize_probabilities,
    quantize_queries,
    sparse_attention,
)

#: Every finite e4m3 value (253 of the 256 codes; the others are the two NaNs and -0 duplicates).
E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3_GRID = E4M3_GRID[torch.isfinite(E4M3_GRID)].unique()
#: Relative half step of a 3-bit mantissa, and the absolute half step of the subnormals (2**-9 / 2).
HALF_STEP = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


def group_amax(q: torch.Tensor, starts: list[int], seqlens_q: list[int], num_kv_heads: int) -> torch.Tensor:
    """``(B, Hkv)`` amax of each (request, KV head group), with explicit loops."""
    g = q.shape[1] // num_kv_heads
    out = torch.zeros(len(seqlens_q), num_kv_heads, dtype=torch.float64)
    for b, (start, n) in enumerate(zip(starts, seqlens_q)):
        for h in range(num_kv_heads):
            if n:
                out[b, h] = q[start : start + n, h * g : (h + 1) * g].double().abs().max()
    return out


def assert_within_e4m3_step(approx: torch.Tensor, exact: torch.Tensor, descale: torch.Tensor) -> None:
    """|approx - exact| <= 2**-4 |exact| for normals, 2**-10 * descale in the subnormal range (plus fp32 slack)."""
    bound = torch.maximum(HALF_STEP * exact.abs(), SUBNORMAL_HALF_STEP * descale) * (1 + 1e-6)
    err = (approx.double() - exact.double()).abs()
    assert (err <= bound).all(), float((err - bound).max())


# ------------------------------------------------------------------- queries
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_queries_scales_and_error(paged_case, dtype):
    case = paged_case([37, 0, 64], [37, 20, 100], num_q_heads=8, num_kv_heads=2, dtype=dtype, fill=0.0)
    # Heads of the second group get a 100x larger range: their scale must not leak into group 0.
    q = case.q.clone()
    q[:, 4:] *= 100
    q_fp8, q_descale = quantize_queries(q, case.batch, 2)
    assert q_fp8.dtype == torch.float8_e4m3fn and q_fp8.shape == q.shape
    assert q_descale.dtype == torch.float32 and q_descale.shape == (3, 2)

    amax = group_amax(q, case.starts, case.seqlens_q, 2)
    want = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_E4M3_MAX)
    torch.testing.assert_close(q_descale.double(), want, rtol=1e-6, atol=0)
    assert q_descale[1].tolist() == [1.0, 1.0]  # zero-length request: nothing to scale

    deq = dequantize_queries(q_fp8, q_descale, case.batch)
    per_row = torch.cat([q_descale[b].repeat_interleave(4).expand(n, 8) for b, n in enumerate(case.seqlens_q)])
    assert_within_e4m3_step(deq, q.double(), per_row[:, :, None].double())
    # The largest magnitude of each group lands on +-448 exactly.
    assert float(q_fp8.float().abs().max()) == FP8_E4M3_MAX
    rel = ((deq.double() - q.double()).abs() / q.double().abs())[q.double().abs() > 1e-2 * per_row[:, :, None]]
    assert rel.median() <= 2.0**-5  # typical error is well under the worst-case half step


def test_quantized_values_lie_on_the_grid(paged_case):
    case = paged_case([20], [20], num_q_heads=4, num_kv_heads=1, fill=0.0)
    q_fp8, _ = quantize_queries(case.q, case.batch, 1)
    assert torch.isin(q_fp8.double(), E4M3_GRID).all()


# ------------------------------------------------------------------- cache
def test_quantize_cache_one_scale_per_kv_head(paged_case):
    case = paged_case([10, 30], [50, 30], num_q_heads=4, num_kv_heads=2, page_size=16, fill=0.0)
    cache = case.k_cache.clone()
    cache[..., 1, :] *= 0.01  # head 1 much smaller: its own scale keeps its precision
    cache_fp8, descale = quantize_cache(cache, case.batch)
    assert cache_fp8.dtype == torch.float8_e4m3fn and cache_fp8.shape == cache.shape
    assert descale.dtype == torch.float32 and descale.shape == (2, 2)
    assert torch.equal(descale[0], descale[1])  # pages may be shared: the same scale for every request
    for h in range(2):
        amax = max(float(case.keys[b][:, h].abs().max()) * (0.01 if h else 1.0) for b in range(2))
        assert float(descale[0, h]) == pytest.approx(amax / FP8_E4M3_MAX, rel=1e-6)
    deq = dequantize_cache(cache_fp8, descale)
    assert_within_e4m3_step(deq, cache.double(), descale[0].double()[None, None, :, None])
    torch.testing.assert_close(dequantize_cache(cache_fp8, descale[0]), deq)  # (Hkv,) is accepted too


def test_dequantize_cache_refuses_per_request_scales(paged_case):
    case = paged_case([4, 4], [8, 4], num_q_heads=2, num_kv_heads=1, page_size=4, fill=0.0)
    cache_fp8, descale = quantize_cache(case.k_cache, case.batch)
    with pytest.raises(ValueError, match="descale rows differ"):
        dequantize_cache(cache_fp8, descale * torch.tensor([[1.0], [2.0]]))
    with pytest.raises(ValueError, match=r"descale must have shape \(B, 1\) or \(1,\)"):
        dequantize_cache(cache_fp8, torch.ones(3))
    with pytest.raises(TypeError, match="cache_fp8 must have dtype"):
        dequantize_cache(case.k_cache, descale)


# ------------------------------------------------------------------- zero and non-finite
def test_zero_inputs_do_not_divide_by_zero(paged_case):
    case = paged_case([6, 3], [6, 3], num_q_heads=4, num_kv_heads=2, page_size=4, fill=0.0)
    zeros_q = torch.zeros_like(case.q)
    q_fp8, q_descale = quantize_queries(zeros_q, case.batch, 2)
    assert torch.equal(q_descale, torch.ones(2, 2))
    assert torch.equal(dequantize_queries(q_fp8, q_descale, case.batch), zeros_q)
    cache_fp8, descale = quantize_cache(torch.zeros_like(case.k_cache), case.batch)
    assert torch.equal(descale, torch.ones(2, 2))
    assert (dequantize_cache(cache_fp8, descale) == 0).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_values_poison_only_their_group(paged_case, bad):
    case = paged_case([6, 5], [6, 5], num_q_heads=4, num_kv_heads=2, page_size=4, fill=0.0)
    q = case.q.clone()
    q[7, 2, 3] = bad  # request 1, KV head group 1
    q_fp8, q_descale = quantize_queries(q, case.batch, 2)
    clean_fp8, clean_descale = quantize_queries(case.q, case.batch, 2)
    assert not math.isfinite(float(q_descale[1, 1]))
    deq = dequantize_queries(q_fp8, q_descale, case.batch)
    assert torch.isnan(deq[6:11, 2:4]).all()  # the whole group becomes NaN
    mask = torch.ones_like(deq, dtype=torch.bool)
    mask[6:11, 2:4] = False
    assert torch.equal(deq[mask], dequantize_queries(clean_fp8, clean_descale, case.batch)[mask])


# ------------------------------------------------------------------- probabilities
def test_quantize_probabilities_grid_and_error():
    gen = torch.Generator().manual_seed(0)
    p = torch.cat(
        [
            torch.rand(5000, generator=gen, dtype=torch.float64),
            torch.exp(-20 * torch.rand(5000, generator=gen, dtype=torch.float64)),  # down to e^-20
            torch.tensor([0.0, 1.0, 2.0**-8, 2.0**-12, 2.0**-18, 2.0**-20], dtype=torch.float64),
        ]
    )
    r = quantize_probabilities(p)
    assert r.dtype == p.dtype and r.shape == p.shape
    assert torch.isin(r * 256, E4M3_GRID).all()  # on the e4m3 grid divided by 256
    normal = p * 256 >= 2.0**-6
    assert (r[normal] - p[normal]).abs().le(HALF_STEP * p[normal] * (1 + 1e-9)).all()
    assert (r[~normal] - p[~normal]).abs().le(SUBNORMAL_HALF_STEP / 256).all()
    assert r[-6:-2].tolist() == [0.0, 1.0, 2.0**-8, 2.0**-12]  # exact powers of two stay exact
    # Without the 2**8 shift, 2**-12 would fall below the smallest e4m3 subnormal and vanish.
    assert float(torch.tensor(2.0**-12).to(torch.float8_e4m3fn).float()) == 0.0


def test_quantize_probabilities_keeps_nan_and_dtype():
    p = torch.tensor([0.5, math.nan, 0.25], dtype=torch.float32)
    r = quantize_probabilities(p)
    assert r.dtype == torch.float32 and math.isnan(float(r[1])) and r[0] == 0.5 and r[2] == 0.25
    with pytest.raises(TypeError, match="p must have dtype"):
        quantize_probabilities(torch.tensor([1, 2]))


# ------------------------------------------------------------------- attention
def fp8_inputs(case):
    q_fp8, q_descale = quantize_queries(case.q, case.batch, case.num_kv_heads)
    k_fp8, k_descale = quantize_cache(case.k_cache, case.batch)
    v_fp8, v_descale = quantize_cache(case.v_cache, case.batch)
    return (q_fp8, k_fp8, v_fp8), {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}


@pytest.mark.parametrize("group", [1, 4])
def test_fp8_dense_attention_matches_dequantised_and_full_precision(paged_case, group):
    case = paged_case([37, 0, 64], [37, 20, 150], num_q_heads=2 * group, num_kv_heads=2, page_size=16, fill=0.0)
    (q8, k8, v8), descales = fp8_inputs(case)
    out8 = dense_attention(q8, k8, v8, case.batch, **descales)

    # Same data, dequantised by hand: the FP8 path is exactly "dequantise, then attend".
    q_deq = dequantize_queries(q8, descales["q_descale"], case.batch)
    k_deq = dequantize_cache(k8, descales["k_descale"])
    v_deq = dequantize_cache(v8, descales["v_descale"])
    torch.testing.assert_close(out8, dense_attention(q_deq, k_deq, v_deq, case.batch), rtol=1e-5, atol=1e-5)

    # Against the unquantised inputs, the error is that of e4m3 rounding (a few percent).
    full = dense_attention(case.q, case.k_cache, case.v_cache, case.batch)
    bf16 = dense_attention(case.q.bfloat16(), case.k_cache.bfloat16(), case.v_cache.bfloat16(), case.batch)
    rel8 = float((out8 - full).norm() / full.norm())
    rel16 = float((bf16 - full).norm() / full.norm())
    assert 1e-3 < rel8 < 0.08  # measured ~0.053 with these fairly sharp logits
    assert rel16 < 0.01 and rel16 < rel8 / 5  # bf16 is the finer format


def test_fp8_sparse_attention_matches_dequantised(paged_case, hand_index):
    case = paged_case([40, 30], [100, 30], num_q_heads=4, num_kv_heads=2, page_size=16, fill=0.0)
    index, _ = hand_index(
        case.batch, num_kv_heads=2, group=2, tile_size=16, block_size=16, keep=lambda seg: seg.kept[::2]
    )
    (q8, k8, v8), descales = fp8_inputs(case)
    got = sparse_attention(q8, k8, v8, case.batch, index, **descales)
    q_deq = dequantize_queries(q8, descales["q_descale"], case.batch)
    k_deq = dequantize_cache(k8, descales["k_descale"])
    v_deq = dequantize_cache(v8, descales["v_descale"])
    torch.testing.assert_close(got, sparse_attention(q_deq, k_deq, v_deq, case.batch, index), rtol=1e-5, atol=1e-5)


def test_fp8_attention_uses_each_request_descale(paged_case):
    """Per-request descales are honoured (the published code dropped the query descale)."""
    case = paged_case([8, 8], [8, 8], num_q_heads=2, num_kv_heads=1, page_size=4, fill=0.0)
    (q8, k8, v8), descales = fp8_inputs(case)
    out = dense_attention(q8, k8, v8, case.batch, return_lse=True, **descales)[1]
    doubled = dict(descales, q_descale=descales["q_descale"] * torch.tensor([[1.0], [2.0]]))
    out2 = dense_attention(q8, k8, v8, case.batch, return_lse=True, **doubled)[1]
    assert torch.equal(out[:8], out2[:8]) and not torch.allclose(out[8:], out2[8:])
    with pytest.raises(ValueError, match="q_descale is required"):
        dense_attention(q8, k8, v8, case.batch)


def test_quantize_queries_bad_arguments(paged_case):
    case = paged_case([4], [4], num_q_heads=4, num_kv_heads=2, page_size=4, fill=0.0)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads=3"):
        quantize_queries(case.q, case.batch, 3)
    with pytest.raises(TypeError, match="q must have dtype"):
        quantize_queries(case.q.to(torch.int32), case.batch, 2)
    with pytest.raises(ValueError, match="q must hold"):
        quantize_queries(case.q[:2], case.batch, 2)
