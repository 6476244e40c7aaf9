"""The drifting background of the planted workload: AR(1) statistics, RoPE, and what the workload keeps."""

from __future__ import annotations

import math

import pytest
import torch

from fpv2.kernel.reference.paged import gather_kv
from fpv2.kernel.reference.pooling import pool_request
from fpv2.kernel.testing import planted_workload
from fpv2.kernel.testing.drifting import ar1_sequence, rotary


@pytest.mark.parametrize("drift_tokens", [8.0, 64.0])
def test_ar1_sequence_has_unit_variance_and_geometric_correlation(drift_tokens):
    x = ar1_sequence(20_000 + 7, (4, 16), drift_tokens, torch.Generator().manual_seed(1))
    assert x.shape == (20_007, 4, 16) and x.dtype == torch.float32
    assert abs(float(x.var()) - 1.0) < 0.08
    rho = math.exp(-1.0 / drift_tokens)
    for lag in (1, int(drift_tokens), 3 * int(drift_tokens)):
        corr = float((x[:-lag] * x[lag:]).mean())
        assert abs(corr - rho**lag) < 0.06, (lag, corr, rho**lag)
    # The first tokens are already stationary (no warm-up transient).
    first = ar1_sequence(200, (1000,), drift_tokens, torch.Generator().manual_seed(2))
    assert abs(float(first[0].var()) - 1.0) < 0.15 and abs(float(first[40].var()) - 1.0) < 0.15


def test_ar1_sequence_continues_across_its_chunks():
    # Token 32 (first of the second chunk) follows token 31 as closely as any neighbour pair.
    x = ar1_sequence(64, (4000,), 100.0, torch.Generator().manual_seed(3))
    step = (x[1:] - x[:-1]).pow(2).mean(dim=1)
    assert float(step[31]) < 2.0 * float(step.median())


def test_ar1_sequence_is_reproducible_and_checks_its_arguments():
    a = ar1_sequence(100, (3,), 10.0, torch.Generator().manual_seed(4))
    b = ar1_sequence(100, (3,), 10.0, torch.Generator().manual_seed(4))
    assert torch.equal(a, b)
    assert ar1_sequence(0, (2, 3), 10.0, torch.Generator()).shape == (0, 2, 3)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="drift_tokens"):
            ar1_sequence(10, (2,), bad, torch.Generator())
    with pytest.raises(ValueError, match="length"):
        ar1_sequence(-1, (2,), 5.0, torch.Generator())


def test_rotary_keeps_norms_and_scores_depend_on_relative_position():
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 64, generator=gen, dtype=torch.float64), torch.randn(1, 2, 64, dtype=torch.float64)
    rq = rotary(q, torch.tensor([100]))
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1))
    near = (rotary(q, torch.tensor([100])) * rotary(k, torch.tensor([90]))).sum(-1)
    shifted = (rotary(q, torch.tensor([5100])) * rotary(k, torch.tensor([5090]))).sum(-1)
    other = (rotary(q, torch.tensor([100])) * rotary(k, torch.tensor([60]))).sum(-1)
    assert torch.allclose(near, shifted) and not torch.allclose(near, other)
    assert torch.equal(rotary(q, torch.tensor([0])), q)


def test_without_drift_the_background_is_the_plain_gaussian_draw():
    # The benchmark's planted workload must not change: V is the generator's second N(0, 1) draw, untouched.
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32, seed=5)
    w = planted_workload([300], [700], **kw)
    gen = torch.Generator().manual_seed(5)
    torch.randn(2, 64, generator=gen)  # head directions
    torch.randperm(w.batch.num_pages, generator=gen)  # page shuffle
    torch.randn(w.k_cache.shape, generator=gen)  # keys
    assert torch.equal(w.v_cache, torch.randn(w.v_cache.shape, generator=gen))
    assert torch.equal(w.q, planted_workload([300], [700], drift_tokens=None, **kw).q)


def _pooled_keys(w, head):
    keys = gather_kv(w.k_cache, w.batch, 0)
    pooled, _ = pool_request(keys, block_size=128)
    return pooled[:, head]


def test_drifting_workload_makes_neighbouring_blocks_alike_and_far_ones_differ():
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=1, dtype=torch.float32, seed=6)
    plain = planted_workload([4096], **kw)
    drifting = planted_workload([4096], drift_tokens=256.0, **kw)
    assert drifting.k_cache.shape == plain.k_cache.shape and drifting.q.shape == plain.q.shape

    def neighbour_and_far(w):
        pooled = _pooled_keys(w, 1)
        unplanted = ~w.planted_blocks[0][1]
        pooled = pooled - pooled[unplanted].mean(dim=0)
        cos = torch.nn.functional.cosine_similarity
        pairs_near = [(j, j + 1) for j in range(len(pooled) - 1) if unplanted[j] and unplanted[j + 1]]
        pairs_far = [(j, j + 16) for j in range(len(pooled) - 16) if unplanted[j] and unplanted[j + 16]]
        near = torch.stack([cos(pooled[a], pooled[b], dim=0) for a, b in pairs_near]).mean()
        far = torch.stack([cos(pooled[a], pooled[b], dim=0) for a, b in pairs_far]).mean()
        return float(near), float(far)

    near, far = neighbour_and_far(drifting)
    assert near > 0.3 and near > far + 0.3, (near, far)  # RoPE turns the head mean into a distance pattern
    near_plain, _ = neighbour_and_far(plain)
    assert abs(near_plain) < 0.1  # i.i.d. blocks: neighbours no more alike than any pair
    # Values drift too, and keys vary between blocks far more than on the plain background.
    values = gather_kv(drifting.v_cache, drifting.batch, 0)
    assert float((values[1:] * values[:-1]).mean()) > 0.9
    assert float(_pooled_keys(drifting, 0).var(dim=0).mean()) > 10 * float(_pooled_keys(plain, 0).var(dim=0).mean())


def test_drifting_workload_keeps_the_planted_margin_at_any_distance():
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32, seed=7)
    w = planted_workload([256], [8192], fraction=0.05, drift_tokens=128.0, **kw)
    again = planted_workload([256], [8192], fraction=0.05, drift_tokens=128.0, **kw)
    assert torch.equal(w.q, again.q) and torch.equal(w.k_cache, again.k_cache) and torch.equal(w.v_cache, again.v_cache)
    keys = gather_kv(w.k_cache, w.batch, 0)
    planted = w.planted_blocks[0][0]
    far = torch.zeros(64, dtype=torch.bool)
    far[:32] = True  # the first 4K tokens: 4K-8K tokens away from the queries
    q = w.q[:, 0:2].mean(dim=1)
    logits = (q @ keys[:, 0].T) / 8.0
    token_planted = (planted & far).repeat_interleave(128)
    token_rest = (~planted & far).repeat_interleave(128)
    assert token_planted.any()
    gap = logits[:, token_planted].mean() - logits[:, token_rest].mean()
    assert 5.0 < float(gap) < 9.0


def test_drifting_workload_refuses_a_bad_correlation_length():
    for bad in (0, -3.0, math.nan, math.inf, "256", True):
        with pytest.raises(ValueError, match="drift_tokens"):
            planted_workload([128], num_q_heads=2, num_kv_heads=1, head_dim=16, drift_tokens=bad)
