"""build_block_index: input validation, shared statistics, FP8 descales, devices."""

from __future__ import annotations

import pytest
import torch
from index_testlib import kept_lists, make_case

from fpv2.index import SelectionConfig, build_block_index
from fpv2.index.reference import select_blocks
from fpv2.kernel.reference.fp8 import quantize_cache, quantize_queries
from fpv2.kernel.reference.pooling import pool_blocks

CFG = SelectionConfig(block_size=32, tile_size=64, sink_tokens=32, window_tokens=64, min_sparse_kv_len=0, alpha=0.2)


@pytest.fixture(scope="module")
def case():
    return make_case(
        [150, 0, 90], [400, 30, 90], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, block_size=32
    )


def same_index(a, b):
    return torch.equal(a.offsets, b.offsets) and torch.equal(a.blocks, b.blocks)


def test_default_config_and_given_statistics(case):
    default = build_block_index(case.q, case.k_cache, case.batch)
    assert (default.tile_size, default.block_size) == (128, 128)
    # Requests shorter than min_sparse_kv_len=8192 are dense by default.
    assert default.density(case.batch) == 1.0
    stats = pool_blocks(case.k_cache, None, case.batch, block_size=32)
    assert same_index(
        build_block_index(case.q, case.k_cache, case.batch, config=CFG, statistics=stats),
        build_block_index(case.q, case.k_cache, case.batch, config=CFG),
    )


def test_softmax_scale_matters(case):
    sharp = build_block_index(
        case.q, case.k_cache, case.batch, config=SelectionConfig(**{**CFG.__dict__, "softmax_scale": 1.0})
    )
    flat = build_block_index(
        case.q, case.k_cache, case.batch, config=SelectionConfig(**{**CFG.__dict__, "softmax_scale": 1e-4})
    )
    # Near-zero logits give near-equal energies: every candidate passes; a sharp scale prunes.
    assert flat.nnz > sharp.nnz


def test_bad_inputs_name_the_argument(case):
    with pytest.raises(TypeError, match="config must be a SelectionConfig"):
        build_block_index(case.q, case.k_cache, case.batch, config={"alpha": 0.1})
    with pytest.raises(TypeError, match="strategy must be a strategy name or a SelectionStrategy"):
        build_block_index(case.q, case.k_cache, case.batch, strategy=3)
    with pytest.raises(ValueError, match=r"q must hold cu_seqlens_q\[-1\]=240 packed queries"):
        build_block_index(case.q[:10], case.k_cache, case.batch, config=CFG)
    with pytest.raises(TypeError, match="q must have dtype"):
        build_block_index(case.q.long(), case.k_cache, case.batch, config=CFG)
    with pytest.raises(ValueError, match="Hq % Hkv != 0"):
        build_block_index(case.q[:, :3].contiguous(), case.k_cache, case.batch, config=CFG)
    stats64 = pool_blocks(case.k_cache, None, case.batch, block_size=64)
    with pytest.raises(ValueError, match="statistics were pooled with block_size=64, the selection uses block_size=32"):
        build_block_index(case.q, case.k_cache, case.batch, config=CFG, statistics=stats64)
    stats = pool_blocks(case.k_cache[:, :, :1].contiguous(), None, case.batch, block_size=32)
    with pytest.raises(ValueError, match="statistics have Hkv=1 heads, k_cache has Hkv=2"):
        build_block_index(case.q, case.k_cache, case.batch, config=CFG, statistics=stats)
    other = make_case([150, 0, 90], [400, 30, 200], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    stats_other = pool_blocks(other.k_cache, None, other.batch, block_size=32)
    with pytest.raises(ValueError, match="block_offsets .* do not match the batch"):
        select_blocks(case.q, case.batch, stats_other, config=CFG)
    with pytest.raises(ValueError, match="q_descale is only meaningful for float8_e4m3fn"):
        build_block_index(case.q, case.k_cache, case.batch, config=CFG, q_descale=torch.ones(3, 2))


def test_fp8_matches_dequantised_inputs(case):
    q8, q_descale = quantize_queries(case.q, case.batch, 2)
    k8, k_descale = quantize_cache(torch.nan_to_num(case.k_cache), case.batch)
    with pytest.raises(ValueError, match="q_descale is required for float8_e4m3fn"):
        build_block_index(q8, k8, case.batch, config=CFG)
    index8 = build_block_index(q8, k8, case.batch, config=CFG, q_descale=q_descale, k_descale=k_descale)
    # The same selection on the real-valued (dequantised) tensors.
    q_real = (
        q8.float()
        * q_descale.repeat_interleave(torch.tensor([150, 0, 90]), dim=0).repeat_interleave(4, dim=1)[..., None]
    )
    k_real = k8.float() * k_descale[0][None, None, :, None]
    index32 = build_block_index(q_real, k_real, case.batch, config=CFG)
    differ = [s for s, (a, b) in enumerate(zip(kept_lists(index8), kept_lists(index32))) if a != b]
    assert len(differ) <= 1, f"segments {differ} differ"  # at most a rounding tie at the threshold
    # The query descale enters the logit scale: a tiny one flattens the energies and keeps more blocks.
    flat = build_block_index(q8, k8, case.batch, config=CFG, q_descale=q_descale * 1e-3, k_descale=k_descale)
    assert flat.nnz > index8.nnz


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu(case):
    cpu = build_block_index(case.q, case.k_cache, case.batch, config=CFG)
    gpu = build_block_index(case.q.cuda(), case.k_cache.cuda(), case.batch.to("cuda"), config=CFG)
    assert gpu.blocks.is_cuda
    differ = [s for s, (a, b) in enumerate(zip(kept_lists(cpu), kept_lists(gpu))) if a != b]
    assert len(differ) <= 1
