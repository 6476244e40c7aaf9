"""The second-order mass shift of the correction: the contract, the reference, the Triton spread and attention.

A plan that carries a :class:`~fpv2.kernel.KeySpread` asks every kernel for the
shift ``min(scale^2 |q|^2 var_J / 2, scale |q| rad_J)`` on each pooled logit. The
reference adds it in :func:`~fpv2.kernel.reference.sparse.sparse_attention`; the
Triton kernel adds it in its correction steps and computes the spread itself
(:func:`~fpv2.kernel.triton.key_spread_triton`); the native struct hands the
spread to the Hopper kernel (ABI 1.5), which adds it in its pooled tiles.
Independent checks: the spread against a block-by-block fp64 computation from the
contiguous keys, the reference against logits written out here, the Triton and
Hopper kernels against the reference.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from fpv2.kernel import CorrectionPlan, KeySpread
from fpv2.kernel import _native as native
from fpv2.kernel._native import structs as native_structs
from fpv2.kernel._native.errors import UnsupportedConfigurationError
from fpv2.kernel.reference import (
    gather_kv,
    pool_blocks,
    quantize_cache,
    quantize_queries,
    second_order_shift,
    sparse_attention,
)
from fpv2.kernel.reference import sparse as reference_sparse
from fpv2.kernel.reference.pooled_e4m3 import dequantize_pooled_e4m3, quantize_pooled_e4m3_reference

F64 = torch.float64
SEQLENS_Q = [200, 0, 90]
SEQLENS_K = [200, 40, 470]

triton_runs = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before triton is imported",
)


def direct_spread(case, block_size: int, keys_per_request=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total_blocks, Hkv)`` variance and radius, block by block in fp64 from the case's contiguous keys."""
    variance, radius = [], []
    for keys in case.keys if keys_per_request is None else keys_per_request:
        keys = keys.double()
        for start in range(0, keys.shape[0], block_size):
            dev2 = (keys[start : start + block_size] - keys[start : start + block_size].mean(0)).pow(2).sum(-1)
            variance.append(dev2.mean(0) / keys.shape[-1])
            radius.append(dev2.max(0).values.sqrt())
    return torch.stack(variance), torch.stack(radius)


def spread_of(case, block_size: int) -> KeySpread:
    variance, radius = direct_spread(case, block_size)
    device = case.k_cache.device
    return KeySpread(variance.float().to(device), radius.float().to(device))


def every_other_block(seg):
    """Keep block 0, the diagonal band and every third block: the rest are todo."""
    return [0, *seg.diagonal_band, *(j for j in seg.kept if j % 3 == 0)]


def explicit_words(segments, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(todo_offsets, todo_masks)``: bit ``j % 64`` of word ``j // 64`` for each eligible block not kept."""
    offsets, words = [0], []
    for seg in segments:
        seg_words = [0] * -(-seg.num_eligible // 64)
        for j in set(range(seg.num_eligible)) - set(seg.kept):
            seg_words[j // 64] |= 1 << (j % 64)
        words.extend(w - (1 << 64) if w >= 1 << 63 else w for w in seg_words)
        offsets.append(len(words))
    return (torch.tensor(offsets, dtype=torch.int32, device=device),
            torch.tensor(words, dtype=torch.int64, device=device))  # fmt: skip


# --------------------------------------------------------------------------- contract
def test_plan_with_a_spread_asks_for_the_second_order_shift(paged_case):
    case = paged_case(SEQLENS_Q, SEQLENS_K)
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=64)
    assert CorrectionPlan(stats).mass_shift == "mean"
    spread = spread_of(case, 64)
    assert CorrectionPlan(stats, key_spread=spread).mass_shift == "second_order"
    with pytest.raises(TypeError, match="key_spread must be a KeySpread"):
        CorrectionPlan(stats, key_spread=(spread.variance, spread.radius))
    with pytest.raises(ValueError, match="key_spread.variance must have shape"):
        CorrectionPlan(stats, key_spread=KeySpread(spread.variance[1:], spread.radius[1:]))


def test_spread_contract_names_the_bad_tensor():
    ok = torch.zeros(6, 2)
    with pytest.raises(TypeError, match="variance must have dtype"):
        KeySpread(ok.double(), ok)
    with pytest.raises(ValueError, match="radius must have rank 2"):
        KeySpread(ok, ok[:, 0])
    with pytest.raises(ValueError, match="radius"):
        KeySpread(ok, torch.zeros(5, 2))
    with pytest.raises(ValueError, match="contiguous"):
        KeySpread(torch.zeros(2, 6).T, ok)


def test_native_struct_carries_the_spread(paged_case):
    case = paged_case(SEQLENS_Q, SEQLENS_K)
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch)
    mean = native_structs.correction_plan_struct(CorrectionPlan(stats))
    assert mean.key_variance.data is None and mean.key_radius.data is None  # the mean shift: absent
    spread = spread_of(case, 128)
    struct = native_structs.correction_plan_struct(CorrectionPlan(stats, key_spread=spread))
    assert struct.key_variance.data == spread.variance.data_ptr() and struct.key_radius.data == spread.radius.data_ptr()


# --------------------------------------------------------------------------- reference
def test_shift_formula_and_its_cap():
    rows = torch.tensor([[3.0, 4.0], [30.0, 40.0], [0.0, 0.0]], dtype=F64)  # |q| = 5, 50, 0
    variance, radius = torch.tensor([0.5, 2.0], dtype=F64), torch.tensor([1.0, 1.0], dtype=F64)
    shift = second_order_shift(rows, variance, radius, 0.5)
    # scale^2 |q|^2 var / 2 against scale |q| rad: row 0 (3.125 var against 2.5) keeps the quadratic
    # term for var 0.5 and hits the cap for var 2; row 1 (312.5 var against 25) is capped; the zero row adds 0.
    want = torch.tensor([[1.5625, 2.5], [25.0, 25.0], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(shift, want)


def test_reference_adds_the_shift_to_each_pooled_logit(paged_case, oracle, hand_index, index_token_masks):
    block = 64
    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, q_gain=3.0, seed=5)
    index, segments = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=128, block_size=block,
                                 keep=every_other_block)  # fmt: skip
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=block)
    spread = spread_of(case, block)
    scale = 1 / 8
    variance, radius = direct_spread(case, block)
    first_row = [0]
    for keys in case.keys:
        first_row.append(first_row[-1] + -(-keys.shape[0] // block))
    todo = {}
    for seg in segments:
        cols = [j for j in range(seg.num_eligible) if j not in set(seg.kept)]
        for r in range(seg.row_begin, seg.row_end):
            mask = todo.setdefault((seg.request, seg.kv_head * 4 + r % 4), torch.zeros(case.seqlens_q[seg.request],
                                   first_row[seg.request + 1] - first_row[seg.request], dtype=torch.bool))  # fmt: skip
            mask[r // 4, cols] = True

    def extra(b, hq):
        h, rows = hq // 4, slice(first_row[b], first_row[b + 1])
        keys, values = case.keys[b][:, h].double(), case.values[b][:, h].double()
        n = -(-keys.shape[0] // block)
        kbar = torch.stack([keys[j * block : (j + 1) * block].mean(0) for j in range(n)])
        vbar = torch.stack([values[j * block : (j + 1) * block].mean(0) for j in range(n)])
        lengths = torch.tensor([min(block, keys.shape[0] - j * block) for j in range(n)], dtype=F64)
        q = case.q[case.starts[b] : case.starts[b + 1], hq].double()
        norm = q.norm(dim=1, keepdim=True) * scale
        shift = torch.minimum(0.5 * norm**2 * variance[rows, h][None], norm * radius[rows, h][None])
        logits = q @ kbar.T * scale + torch.log(lengths)[None] + shift
        return logits.masked_fill(~todo[(b, hq)], -math.inf), vbar

    want, _ = oracle(case, allowed=index_token_masks(case, segments, block), extra=extra)
    got = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index,
                           plan=CorrectionPlan(stats, key_spread=spread), compute_dtype=F64)  # fmt: skip
    mean_only = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(stats),
                                 compute_dtype=F64)  # fmt: skip
    torch.testing.assert_close(got, want.to(got.device), rtol=1e-6, atol=1e-6)
    assert float((got - mean_only).abs().max()) > 0.05, "the shift changes nothing here: the test cannot fail"


# --------------------------------------------------------------------------- Triton
@triton_runs
@pytest.mark.parametrize(("page_size", "block_size", "dtype"),
                         [(1, 128, torch.float32), (16, 64, torch.float16), (16, 32, torch.float32)])  # fmt: skip
def test_triton_spread_matches_a_block_by_block_computation(paged_case, device, page_size, block_size, dtype):
    from fpv2.kernel.triton import key_spread_triton

    case = paged_case(SEQLENS_Q, SEQLENS_K, page_size=page_size, dtype=dtype, device=device, seed=page_size)
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=block_size)
    spread = key_spread_triton(case.k_cache, case.batch, stats)
    variance, radius = direct_spread(case, block_size)
    torch.testing.assert_close(spread.variance.cpu().double(), variance, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(spread.radius.cpu().double(), radius, rtol=1e-5, atol=1e-6)


@triton_runs
def test_triton_spread_keeps_its_precision_far_from_the_origin(paged_case, device):
    """Keys at 300 + N(0, 1): E|k|^2 - |kbar|^2 in fp32 would lose the unit variance to cancellation."""
    from fpv2.kernel.triton import key_spread_triton

    case = paged_case([40], [300], page_size=16, device=device, seed=8)
    offset = 300.0
    k_cache = case.k_cache + offset
    case.keys[0] = case.keys[0] + offset
    stats = pool_blocks(k_cache, case.v_cache, case.batch)
    spread = key_spread_triton(k_cache, case.batch, stats)
    variance, radius = direct_spread(case, 128)
    torch.testing.assert_close(spread.variance.cpu().double(), variance, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(spread.radius.cpu().double(), radius, rtol=1e-3, atol=1e-3)


@triton_runs
def test_triton_spread_refuses_bad_arguments(paged_case, device):
    from fpv2.kernel.triton import key_spread_triton

    case = paged_case(SEQLENS_Q, SEQLENS_K, device=device)
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch)
    with pytest.raises(TypeError, match="statistics must be a BlockStatistics"):
        key_spread_triton(case.k_cache, case.batch, None)
    with pytest.raises(ValueError, match="does not fit k_cache"):
        key_spread_triton(case.k_cache[:, :, :1], case.batch, stats)
    short = type(stats)(stats.pooled_k[:-1], stats.pooled_v[:-1], stats.block_lengths[:-1], stats.block_offsets)
    with pytest.raises(ValueError, match="the batch needs"):
        key_spread_triton(case.k_cache, case.batch, short)  # one block fewer than the batch has
    with pytest.raises(ValueError, match="k_descale is only meaningful"):
        key_spread_triton(case.k_cache, case.batch, stats, k_descale=torch.ones(3, 2, device=device))
    with pytest.raises(ValueError, match="k_cache must have shape"):
        key_spread_triton(case.k_cache[:-1], case.batch, stats)  # a page fewer than the page table addresses


@triton_runs
@pytest.mark.parametrize(
    ("dtype", "block_size", "explicit", "q_gain"),
    [(torch.float32, 128, False, 3.0), (torch.float16, 64, True, 3.0), (torch.float32, 64, False, 40.0)],
    ids=["fp32", "fp16-explicit-words", "fp32-capped"],
)
def test_triton_attention_applies_the_shift_like_the_reference(
    paged_case, hand_index, device, dtype, block_size, explicit, q_gain
):
    """Large queries (``q_gain`` 40) make the radius cap bind for most (row, block) pairs."""
    from fpv2.kernel.triton import key_spread_triton, sparse_attention_triton

    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=1, dtype=dtype, device=device,
                      q_gain=q_gain, seed=13)  # fmt: skip
    index, segments = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=128, block_size=block_size,
                                 keep=every_other_block)  # fmt: skip
    norm = case.q.double().norm(dim=-1).median().item() / 8  # scale |q| of a typical row
    variance, radius = direct_spread(case, block_size)
    capped = 0.5 * norm**2 * variance > norm * radius
    assert bool(capped.all() if q_gain > 10 else not capped.any()), "the inputs do not test what the case says"
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=block_size)
    spread = key_spread_triton(case.k_cache, case.batch, stats)
    plan = CorrectionPlan(stats, key_spread=spread)
    if explicit:  # the todo words written out bit by bit instead of derived from the CSR
        plan = CorrectionPlan(stats, *explicit_words(segments, device), key_spread=spread)
    want = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, compute_dtype=F64)
    mean_only = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(stats),
                                 compute_dtype=F64)  # fmt: skip
    got = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan)
    tolerance = 2e-3 if dtype == torch.float16 else 1e-4  # fp32 logits of a few hundred (q_gain 40)
    assert float((got.double() - want).abs().max()) < tolerance
    assert float((want - mean_only).abs().max()) > 20 * tolerance, "the shift is too small to be seen"


@triton_runs
def test_triton_fp8_shift_uses_the_real_units(paged_case, hand_index, device):
    """FP8 inputs: |q| and the spread are in dequantised units (the query and key descales applied)."""
    from fpv2.kernel.triton import key_spread_triton, sparse_attention_triton

    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=16, device=device, fill=0.0,
                      q_gain=3.0, seed=4)  # fmt: skip
    q8, qd = quantize_queries(case.q, case.batch, 2)
    k8, kd = quantize_cache(case.k_cache, case.batch)
    v8, vd = quantize_cache(case.v_cache, case.batch)
    scales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    index, _ = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=128, block_size=128, keep=every_other_block)
    stats = pool_blocks(k8, v8, case.batch, k_descale=kd, v_descale=vd)
    spread = key_spread_triton(k8, case.batch, stats, k_descale=kd)
    real = [gather_kv(k8, case.batch, b).float().cpu() * kd[b].cpu()[None, :, None] for b in range(3)]
    variance, radius = direct_spread(case, 128, real)
    torch.testing.assert_close(spread.variance.cpu().double(), variance, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(spread.radius.cpu().double(), radius, rtol=1e-4, atol=1e-5)
    plan = CorrectionPlan(stats, key_spread=spread)
    want = sparse_attention(q8, k8, v8, case.batch, index, plan=plan, compute_dtype=F64, **scales)
    mean_only = sparse_attention(q8, k8, v8, case.batch, index, plan=CorrectionPlan(stats), compute_dtype=F64,
                                 **scales)  # fmt: skip
    got = sparse_attention_triton(q8, k8, v8, case.batch, index, plan=plan, **scales)
    got_mean = sparse_attention_triton(q8, k8, v8, case.batch, index, plan=CorrectionPlan(stats), **scales)
    # Relative L2 errors: the kernel's own FP8 rounding (P in e4m3) sets the scale of both.
    err = float((got.double() - want).norm() / want.norm())
    err_mean = float((got_mean.double() - mean_only).norm() / mean_only.norm())
    assert err < 1.5 * err_mean, (err, err_mean)
    assert float((want - mean_only).norm() / want.norm()) > 5 * err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA GPU with compiled (not interpreted) Triton")  # fmt: skip
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_bf16_shift_against_the_reference(paged_case, hand_index, group, page_size, head_dim):
    """bf16 on the GPU, varlen + prefix, GQA 1/4/8, pages 1/16, d 64/128/256: spread and shifted attention."""
    from fpv2.kernel.triton import key_spread_triton, sparse_attention_triton

    case = paged_case([300, 0, 700], [300, 64, 2000], num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                      page_size=page_size, dtype=torch.bfloat16, device="cuda", q_gain=3.0,
                      seed=group + head_dim)  # fmt: skip
    index, _ = hand_index(case.batch, num_kv_heads=2, group=group, tile_size=128, block_size=128,
                          keep=every_other_block)  # fmt: skip
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch)
    spread = key_spread_triton(case.k_cache, case.batch, stats)
    variance, radius = direct_spread(case, 128)
    torch.testing.assert_close(spread.variance.cpu().double(), variance, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(spread.radius.cpu().double(), radius, rtol=1e-4, atol=1e-5)
    plan = CorrectionPlan(stats, key_spread=spread)
    want = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, compute_dtype=F64)
    mean_only = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(stats),
                                 compute_dtype=F64)  # fmt: skip
    got = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan)
    got_mean = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(stats)
    )
    err = float((got.double() - want).norm() / want.norm())
    err_mean = float((got_mean.double() - mean_only).norm() / mean_only.norm())
    assert torch.isfinite(got).all()
    assert err < 1.5 * err_mean + 1e-3, (err, err_mean)
    assert float((want - mean_only).norm() / want.norm()) > 5 * err


# --------------------------------------------------------------------------- Hopper kernel
def e4m3_pooled_logits(stats, dequantized_k: torch.Tensor):
    """The reference's pooled logits computed as the FP8 pooled products compute them.

    The kernel rounds each packed Q row to e4m3 at the scale of its absolute maximum (``448 / amax``) and
    multiplies it by the pooled keys' e4m3 copies (``dequantized_k``: ``dequantize_pooled_e4m3`` of ``stats``);
    the shifts (``log |B_J|``, the second-order one from the unrounded row) are as in the bf16 path. This wraps
    the reference's own pseudo-keys with those operands. Probabilities and values are not rounded here, so it
    predicts the lse, not the output.
    """
    exact_pseudo_keys = reference_sparse._pseudo_keys
    rounded_stats = dataclasses.replace(stats, pooled_k=dequantized_k)

    def pseudo_keys(rows, _stats, stat_rows, kv_head, scale, spread=None):
        amax = rows.float().abs().amax(dim=1, keepdim=True)
        inverse = torch.where(amax > 0, 448.0 / amax, torch.zeros_like(amax))
        rounded = ((rows.float() * inverse).to(torch.float8_e4m3fn).float() * (amax / 448.0)).to(rows.dtype)
        logits, values = exact_pseudo_keys(rounded, rounded_stats, stat_rows, kv_head, scale)
        if spread is not None:  # the second-order shift of the unrounded rows
            idx = torch.tensor(stat_rows, dtype=torch.long, device=spread.variance.device)
            logits = logits + second_order_shift(
                rows, spread.variance[idx, kv_head], spread.radius[idx, kv_head], scale
            )
        return logits, values

    return pseudo_keys


def _hopper_against_the_reference(case, index, stats, monkeypatch=None, **kwargs) -> None:
    """The Hopper kernel with and without the shift, on NaN-poisoned outputs, against the fp64 reference.

    The shifted kernel must sit as close to the shifted reference as the mean-only kernel sits to its own
    reference (output and lse), while the shift moves the reference by far more than that (so that dropping it
    fails). With the FP8 pooled products the lse is compared with a reference whose pooled logits are rounded as
    the kernel rounds them (:func:`e4m3_pooled_logits`, through ``monkeypatch``): the positive second-order shift
    makes the pooled terms most of some rows' mass, and those rows' lse then moves by the e4m3 rounding (0.030 at
    d 64 on the H100, 2026-12-05; reproduced to 4e-4 by that reference on the CPU), where the mean's moves 0.002.
    """
    available, reason = native.hopper_available()
    if not available:
        pytest.skip(reason)
    fp8_pooled = bool(kwargs.get("pooled_e4m3"))
    spread = key_spread_of(case, stats)
    errors, lse_errors, refs = {}, {}, {}
    for name, plan in (("mean", CorrectionPlan(stats)), ("second", CorrectionPlan(stats, key_spread=spread))):
        lse = torch.full(case.q.shape[:2], float("nan"), device="cuda")
        got = native.hopper_prefill(case.q, case.k_cache, case.v_cache, torch.full_like(case.q, float("nan")),
                                    case.batch, index=index, plan=plan, lse=lse, **kwargs)  # fmt: skip
        want, want_lse = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan,
                                          compute_dtype=F64, return_lse=True)  # fmt: skip
        if fp8_pooled:
            dequantized_k, _ = dequantize_pooled_e4m3(
                quantize_pooled_e4m3_reference(stats.pooled_k, stats.pooled_v, stats.block_offsets),
                stats.block_offsets,
            )
            with monkeypatch.context() as patch:
                patch.setattr(reference_sparse, "_pseudo_keys", e4m3_pooled_logits(stats, dequantized_k))
                _, want_lse = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan,
                                               compute_dtype=F64, return_lse=True)  # fmt: skip
        assert torch.isfinite(got).all(), f"{name}: rows left unwritten (NaN poison) or non-finite output"
        assert torch.isfinite(lse).all(), f"{name}: lse rows left unwritten (NaN poison)"
        errors[name] = float((got.double() - want).norm() / want.norm())
        lse_errors[name] = float((lse.double() - want_lse.double()).abs().max())
        refs[name] = want
    moved = float((refs["second"] - refs["mean"]).norm() / refs["second"].norm())
    print(f"hopper shift {kwargs}: output error {errors}, lse error {lse_errors}, shift moves {moved:.4f}")
    assert max(lse_errors.values()) <= (5e-3 if fp8_pooled else 2e-2), lse_errors
    assert lse_errors["second"] <= 1.5 * lse_errors["mean"] + 5e-3, lse_errors
    assert errors["second"] < 1.5 * errors["mean"] + 1e-3, errors
    assert moved > 5 * errors["second"], (moved, errors)


def key_spread_of(case, stats) -> KeySpread:
    """The spread of the case's keys: the Triton pass on CUDA (checked against fp64 above), else block by block."""
    try:
        from fpv2.kernel.triton import key_spread_triton
    except ImportError:  # pragma: no cover - triton is part of the GPU images
        return spread_of(case, 128)
    return key_spread_triton(case.k_cache, case.batch, stats)


HOPPER_HEAD_DIMS = native.hopper_head_dims() or (128,)


@pytest.mark.hopper
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", HOPPER_HEAD_DIMS)
def test_hopper_shift_against_the_reference(paged_case, hand_index, head_dim, group, page_size):
    """Varlen + prefix, GQA 1/4/8, the gather (pages 1, 16) and TMA (128) paths, every built head dim."""
    case = paged_case([300, 0, 700], [300, 64, 2000], num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                      page_size=page_size, dtype=torch.bfloat16, device="cuda", q_gain=3.0,
                      seed=group + head_dim + page_size)  # fmt: skip
    index, _ = hand_index(case.batch, num_kv_heads=2, group=group, tile_size=128, block_size=128,
                          keep=every_other_block)  # fmt: skip
    _hopper_against_the_reference(case, index, pool_blocks(case.k_cache, case.v_cache, case.batch))


@pytest.mark.hopper
@pytest.mark.parametrize("variant", ["pooled-e4m3", "splits"])
@pytest.mark.parametrize("head_dim", HOPPER_HEAD_DIMS)
def test_hopper_shift_with_fp8_pooled_products_and_split_kv(paged_case, hand_index, monkeypatch, head_dim, variant):
    """The FP8 pooled products (the scaled shift) and split-KV (rows counted from the split's first pooled row)."""
    kwargs = {}
    seqlens_q, seqlens_k = [300, 0, 700], [300, 64, 2000]
    if variant == "pooled-e4m3":
        if head_dim == 256:
            pytest.skip("the FP8 correction is built for 128-token tiles (not d = 256)")
        kwargs["pooled_e4m3"] = True
    else:
        monkeypatch.setenv("FPV2_HOPPER_SPLITS", "3")
        seqlens_q, seqlens_k = [64, 200], [8192, 6000]
    case = paged_case(seqlens_q, seqlens_k, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=128,
                      dtype=torch.bfloat16, device="cuda", q_gain=3.0, seed=head_dim + len(variant))  # fmt: skip
    index, _ = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=128, block_size=128,
                          keep=every_other_block)  # fmt: skip
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch)
    _hopper_against_the_reference(case, index, stats, monkeypatch, **kwargs)


@pytest.mark.hopper
@pytest.mark.parametrize(
    "setting",
    [("FPV2_HOPPER_PERSISTENT", "1"), ("FPV2_HOPPER_PERSISTENT", "dynamic"), ("FPV2_HOPPER_OVERLAP", "0")],
)
def test_hopper_refuses_the_shift_on_the_opt_in_schedules(paged_case, hand_index, monkeypatch, setting):
    """Persistent CTAs and the serial consumers do not build the shift: refused by name, never the mean alone."""
    available, reason = native.hopper_available()
    if not available:
        pytest.skip(reason)
    monkeypatch.setenv(*setting)
    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=4, num_kv_heads=2, head_dim=HOPPER_HEAD_DIMS[0],
                      page_size=128, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    index, _ = hand_index(case.batch, num_kv_heads=2, group=2, tile_size=128, block_size=128, keep=every_other_block)
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch)
    out = torch.full_like(case.q, float("nan"))
    native.hopper_prefill(case.q, case.k_cache, case.v_cache, out, case.batch, index=index, plan=CorrectionPlan(stats))
    with pytest.raises(UnsupportedConfigurationError, match="built into the overlapped consumers with one CTA"):
        plan = CorrectionPlan(stats, key_spread=key_spread_of(case, stats))
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, out, case.batch, index=index, plan=plan)


@pytest.mark.hopper
def test_hopper_refuses_a_spread_past_half_its_table(paged_case, hand_index):
    """The spread takes half the shift table: requests past 2^19 blocks' tokens at d = 64 are refused by name."""
    available, reason = native.hopper_available()
    if not available or 64 not in native.hopper_head_dims():
        pytest.skip(reason or "the library has no d = 64 instantiation")
    seqlen = 8192 * 128 + 128  # one block past the second-order limit at d = 64 (16384 / 2 blocks)
    case = paged_case([128], [seqlen], num_q_heads=1, num_kv_heads=1, head_dim=64, page_size=128,
                      dtype=torch.bfloat16, device="cuda", seed=5)  # fmt: skip
    index, _ = hand_index(case.batch, num_kv_heads=1, group=1, tile_size=128, block_size=128,
                          keep=lambda seg: [0, *seg.diagonal_band])  # fmt: skip
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch)
    out = torch.full_like(case.q, float("nan"))
    native.hopper_prefill(case.q, case.k_cache, case.v_cache, out, case.batch, index=index, plan=CorrectionPlan(stats))
    assert torch.isfinite(out).all()  # the mean correction still serves it
    shape = stats.pooled_k.shape[:2]
    zeros = torch.zeros(shape, device="cuda")
    plan = CorrectionPlan(stats, key_spread=KeySpread(zeros, zeros.clone()))
    with pytest.raises(UnsupportedConfigurationError, match="second-order mass shift marks at most 8192 blocks"):
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, out, case.batch, index=index, plan=plan)
