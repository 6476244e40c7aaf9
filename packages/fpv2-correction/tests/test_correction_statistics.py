"""compute_block_statistics: pooled means through the page table, FP8 descales, validation."""

from __future__ import annotations

import pytest
import torch
from correction_testlib import block_means, make_paged

from fpv2.correction import compute_block_statistics
from fpv2.kernel.reference.fp8 import quantize_cache


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("block_size", [16, 128])
def test_pooled_means_and_lengths(page_size, block_size):
    paged = make_paged([5, 0, 70], [300, 0, 70], page_size=page_size, seed=page_size)
    stats = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=block_size)
    assert stats.block_size == block_size and stats.num_kv_heads == 2 and stats.head_dim == 64
    start = 0
    for b in range(len(paged.seqlens_k)):
        mk, lengths = block_means(paged.keys[b], block_size)
        mv, _ = block_means(paged.values[b], block_size)
        nb = mk.shape[0]
        assert int(stats.block_offsets[b]) == start and int(stats.block_offsets[b + 1]) == start + nb
        torch.testing.assert_close(stats.pooled_k[start : start + nb].double(), mk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats.pooled_v[start : start + nb].double(), mv, rtol=1e-5, atol=1e-6)
        assert stats.block_lengths[start : start + nb].tolist() == lengths.tolist()
        start += nb
    assert torch.isfinite(stats.pooled_k).all()  # NaN slots outside the page table were never read


def test_fp8_statistics_are_in_real_units():
    paged = make_paged([40], [200], page_size=16)
    k8, k_descale = quantize_cache(torch.nan_to_num(paged.k_cache), paged.batch)
    v8, v_descale = quantize_cache(torch.nan_to_num(paged.v_cache), paged.batch)
    stats = compute_block_statistics(k8, v8, paged.batch, block_size=64, k_descale=k_descale, v_descale=v_descale)
    real = compute_block_statistics(
        k8.float() * k_descale[0][None, None, :, None],
        v8.float() * v_descale[0][None, None, :, None],
        paged.batch,
        block_size=64,
    )
    torch.testing.assert_close(stats.pooled_k, real.pooled_k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats.pooled_v, real.pooled_v, rtol=1e-5, atol=1e-6)
    # and close to the unquantised means (e4m3 keeps about 2 significant digits; means average it out)
    torch.testing.assert_close(stats.pooled_k.double(), block_means(paged.keys[0], 64)[0], rtol=0, atol=0.03)


def test_validation_names_the_argument():
    paged = make_paged([8], [40], page_size=16)
    k, v, batch = paged.k_cache, paged.v_cache, paged.batch
    with pytest.raises(ValueError, match="block_size must be a positive power of two, got 48"):
        compute_block_statistics(k, v, batch, block_size=48)
    with pytest.raises(TypeError, match="k_cache must have dtype"):
        compute_block_statistics(k.long(), v, batch)
    with pytest.raises(ValueError, match=r"v_cache must have shape \(4, 16, Hkv, d\)"):
        compute_block_statistics(k, v[:, :8], batch)
    with pytest.raises(ValueError, match="k_cache and v_cache must match"):
        compute_block_statistics(k, v[..., :32].contiguous(), batch)
    with pytest.raises(ValueError, match="k_descale is only meaningful for float8_e4m3fn"):
        compute_block_statistics(k, v, batch, k_descale=torch.ones(1, 2))
    k8, v8 = k.nan_to_num().to(torch.float8_e4m3fn), v.nan_to_num().to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"v_descale is required for float8_e4m3fn caches \(shape \(1, 2\)\)"):
        compute_block_statistics(k8, v8, batch, k_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"k_descale must have shape \(1, 2\)"):
        compute_block_statistics(k8, v8, batch, k_descale=torch.ones(2, 2), v_descale=torch.ones(1, 2))
    with pytest.raises(TypeError, match="batch must be a PagedPrefillBatch"):
        compute_block_statistics(k, v, None)
