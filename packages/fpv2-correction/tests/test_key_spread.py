"""The key blocks' spread and the second-order mass shift of the mean correction."""

from __future__ import annotations

import math

import pytest
import torch

from fpv2.correction import build_correction_plan, compute_block_statistics, corrected_attention
from fpv2.correction.key_spread import KeySpread, compute_key_spread, second_order_shift
from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.reference.fp8 import dequantize_cache, quantize_cache
from fpv2.kernel.reference.paged import gather_kv
from fpv2.kernel.testing import planted_workload

F64 = torch.float64


def _workload():
    # Two requests, one continuing a prefix; page 16, shuffled pages; 64-token blocks with tails (300 = 4 x 64 + 44).
    return planted_workload(
        [100, 40], [300, 40], num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, dtype=torch.float32, seed=2
    )


def _direct_spread(k_cache, batch, block):
    """Variance and radius per (block, head), block by block, from the gathered keys."""
    variance, radius = [], []
    for b, kv_len in enumerate(batch.host.seqlens_k):
        keys = gather_kv(k_cache, batch, b).double()
        for start in range(0, kv_len, block):
            chunk = keys[start : start + block]
            dev = (chunk - chunk.mean(dim=0)).pow(2).sum(dim=-1)  # (n, Hkv)
            variance.append(dev.mean(dim=0) / keys.shape[-1])
            radius.append(dev.max(dim=0).values.sqrt())
    return torch.stack(variance), torch.stack(radius)


def test_spread_matches_a_block_by_block_computation():
    w = _workload()
    stats = compute_block_statistics(w.k_cache, w.v_cache, w.batch, block_size=64)
    spread = compute_key_spread(w.k_cache, w.batch, stats)
    assert isinstance(spread, KeySpread) and spread.variance.dtype == torch.float32
    variance, radius = _direct_spread(w.k_cache, w.batch, 64)
    assert spread.variance.shape == (stats.pooled_k.shape[0], 2) == variance.shape
    torch.testing.assert_close(spread.variance.double(), variance, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(spread.radius.double(), radius, rtol=1e-5, atol=1e-6)
    # N(0, 1) keys: about unit variance per dimension in the unplanted blocks.
    assert 0.7 < float(spread.variance.median()) < 1.3


def test_spread_of_fp8_keys_is_that_of_the_dequantised_keys():
    w = _workload()
    k8, k_ds = quantize_cache(w.k_cache, w.batch)
    v8, v_ds = quantize_cache(w.v_cache, w.batch)
    stats8 = compute_block_statistics(k8, v8, w.batch, block_size=64, k_descale=k_ds, v_descale=v_ds)
    spread8 = compute_key_spread(k8, w.batch, stats8, k_descale=k_ds)
    real = dequantize_cache(k8, k_ds)
    variance, radius = _direct_spread(real, w.batch, 64)
    torch.testing.assert_close(spread8.variance.double(), variance, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(spread8.radius.double(), radius, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="k_descale is required"):
        compute_key_spread(k8, w.batch, stats8)


def test_spread_refuses_statistics_of_another_cache():
    w = _workload()
    stats = compute_block_statistics(w.k_cache, w.v_cache, w.batch, block_size=64)
    with pytest.raises(TypeError, match="statistics must be a BlockStatistics"):
        compute_key_spread(w.k_cache, w.batch, object())
    with pytest.raises(TypeError, match="batch must be a PagedPrefillBatch"):
        compute_key_spread(w.k_cache, None, stats)
    with pytest.raises(ValueError, match=r"\(Hkv, d\)"):
        compute_key_spread(w.k_cache[:, :, :1], w.batch, stats)
    other = PagedPrefillBatch.contiguous([100, 40], [300, 40], page_size=16)
    shorter = compute_block_statistics(w.k_cache, w.v_cache, w.batch, block_size=128)
    with pytest.raises(ValueError, match="blocks for request 0"):
        # 128-token statistics read as if their blocks were 64 tokens long.
        compute_key_spread(w.k_cache, other, type(stats)(*_as_block(shorter, 64)))


def _as_block(stats, block):
    return stats.pooled_k, stats.pooled_v, stats.block_lengths, stats.block_offsets, block


def test_shifted_mass_lies_between_the_bounds_and_nearer_the_true_mass():
    # One block of Gaussian keys (with a mean), many query rows: the true mass sum_i exp(s_i) is bracketed by
    # the mean correction's n exp(s_bar) (Jensen) and n exp(s_bar + scale |q| rho); the shifted term stays in
    # that bracket and is nearer the true mass than the unshifted one.
    gen = torch.Generator().manual_seed(4)
    n, d, scale = 128, 64, 1 / 8
    keys = (torch.randn(n, d, generator=gen, dtype=F64) * 0.8 + torch.randn(d, generator=gen, dtype=F64))[:, None]
    mean = keys.mean(dim=0)  # (1, d)
    dev2 = (keys - mean).pow(2).sum(-1)
    spread = KeySpread(variance=(dev2.mean(0) / d)[None].float(), radius=dev2.max(0).values.sqrt()[None].float())
    # Row norms from 1.6 to 240: the largest rows make the quadratic term pass the bound, so the cap binds.
    rows = torch.randn(600, d, generator=gen, dtype=F64) * torch.linspace(0.2, 30.0, 600, dtype=F64)[:, None]
    shift = second_order_shift(rows, spread, torch.tensor([0]), 0, scale)[:, 0]
    s_bar = (rows @ mean[0]) * scale
    true = torch.logsumexp((rows @ keys[:, 0].T) * scale, dim=1)
    lower = s_bar + math.log(n)
    upper = s_bar + scale * rows.norm(dim=1) * float(spread.radius) + math.log(n)
    shifted = lower + shift
    assert bool((true >= lower - 1e-9).all() and (true <= upper + 1e-6).all())
    assert bool((shift >= 0).all() and (shifted <= upper + 1e-6).all())
    uncapped = 0.5 * scale**2 * rows.pow(2).sum(1) * float(spread.variance)
    capped = uncapped > upper - lower
    assert capped.any() and not capped[:100].any()
    torch.testing.assert_close(shift, torch.minimum(uncapped, upper - lower))
    # Where the expansion holds (score spreads of a few nats), the shifted term is far nearer the true mass.
    moderate = rows.norm(dim=1) < 16
    assert int(moderate.sum()) > 30
    assert float((shifted - true)[moderate].abs().mean()) < 0.25 * float((lower - true)[moderate].abs().mean())


@pytest.mark.parametrize("drift_tokens", [None, 256.0], ids=["planted", "drifting"])
def test_the_shift_lowers_the_corrected_error_against_dense(drift_tokens):
    index_api = pytest.importorskip("fpv2.index", reason="needs fpv2-index to select blocks")
    w = planted_workload(
        [1024], [2048], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, margin=3.0, fraction=0.05,
        seed=3, dtype=torch.float32, drift_tokens=drift_tokens,
    )  # fmt: skip
    stats = compute_block_statistics(w.k_cache, w.v_cache, w.batch)
    config = index_api.SelectionConfig(alpha=0.1, min_sparse_kv_len=0, sink_tokens=128, window_tokens=128)
    index = index_api.build_block_index(w.q, w.k_cache, w.batch, config=config, statistics=stats)
    plan = build_correction_plan(index, stats, w.batch)
    spread = compute_key_spread(w.k_cache, w.batch, stats)
    dense = dense_attention(w.q, w.k_cache, w.v_cache, w.batch, compute_dtype=F64)
    mean_only = corrected_attention(w.q, w.k_cache, w.v_cache, w.batch, index, plan, compute_dtype=F64)
    shifted_plan = build_correction_plan(index, stats, w.batch, key_spread=spread)
    assert shifted_plan.mass_shift == "second_order"
    shifted = corrected_attention(w.q, w.k_cache, w.v_cache, w.batch, index, shifted_plan, compute_dtype=F64)

    def err(x):
        return float((x - dense).norm() / dense.norm())

    assert index.density(w.batch) < 0.8
    assert err(shifted) < 0.8 * err(mean_only), (err(shifted), err(mean_only))
