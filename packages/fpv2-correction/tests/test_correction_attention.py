"""Corrected sparse attention: matches an explicit fp64 computation, and beats dropping pruned blocks."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from correction_testlib import block_means, make_paged, random_index

from fpv2.correction import build_correction_plan, compute_block_statistics, corrected_attention
from fpv2.kernel.testing import planted_workload


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_sparse = pytest.mark.skipif(
    not _has("fpv2.kernel.reference.sparse"),
    reason="fpv2.kernel.reference.sparse (the sparse attention reference) is not in this fpv2-kernel yet",
)


def explicit_corrected(paged, segs, block_size):
    """fp64, row by row: kept tokens (causal) plus one pseudo-token per todo block with logit + log|B_J|."""
    g, d = paged.group, paged.q.shape[2]
    scale = 1.0 / math.sqrt(d)
    out = torch.zeros(paged.q.shape, dtype=torch.float64)
    pooled = {}
    for seg in segs:
        b, h = seg.request, seg.kv_head
        if (b, h) not in pooled:
            kbar, lengths = block_means(paged.keys[b][:, h], block_size)
            vbar, _ = block_means(paged.values[b][:, h], block_size)
            pooled[b, h] = (kbar, vbar, lengths)
        kbar, vbar, lengths = pooled[b, h]
        keys, values = paged.keys[b][:, h].double(), paged.values[b][:, h].double()
        todo = [j for j in range(seg.eligible(block_size)) if j not in seg.kept]
        for r in range(seg.row_begin, seg.row_end):
            pos, hq = r // g, h * g + r % g
            qr = paged.q[paged.starts[b] + pos, hq].double()
            tokens = [i for j in seg.kept for i in range(j * block_size, min((j + 1) * block_size, len(keys)))]
            tokens = [i for i in tokens if i <= seg.prefix + pos]
            logits = [keys[tokens] @ qr * scale]
            vals = [values[tokens]]
            if todo:
                logits.append(kbar[todo] @ qr * scale + torch.log(lengths[todo].double()))
                vals.append(vbar[todo])
            weights = torch.softmax(torch.cat(logits), dim=0)
            out[paged.starts[b] + pos, hq] = weights @ torch.cat(vals)
    return out


@needs_sparse
@pytest.mark.parametrize(("group", "page_size"), [(1, 1), (2, 16), (4, 64)])
def test_matches_explicit_fp64_correction(group, page_size):
    paged = make_paged([20, 0, 12], [150, 9, 12], num_q_heads=2 * group, num_kv_heads=2, page_size=page_size, seed=4)
    index, segs = random_index(paged, tile_size=16, block_size=8, keep_prob=0.3, seed=5)
    stats = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=8)
    plan = build_correction_plan(index, stats, paged.batch)
    out, lse = corrected_attention(
        paged.q, paged.k_cache, paged.v_cache, paged.batch, index, plan, compute_dtype=torch.float64, return_lse=True
    )
    expected = explicit_corrected(paged, segs, 8)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert lse.shape == paged.q.shape[:2] and torch.isfinite(lse).all()


@needs_sparse
def test_plan_is_required():
    paged = make_paged([8], [40])
    index, _ = random_index(paged, tile_size=16, block_size=8, keep_prob=0.5, seed=0)
    with pytest.raises(TypeError, match="plan must be a CorrectionPlan, got NoneType"):
        corrected_attention(paged.q, paged.k_cache, paged.v_cache, paged.batch, index, None)


@needs_sparse
@pytest.mark.skipif(not _has("fpv2.index"), reason="needs fpv2-index to select blocks")
def test_correction_brings_sparse_closer_to_dense():
    from fpv2.index import SelectionConfig, build_block_index
    from fpv2.kernel.reference.attention import dense_attention
    from fpv2.kernel.reference.sparse import sparse_attention

    # margin 3: pruned blocks keep several percent of the softmax mass, enough for dropping them to show.
    # Request 0 continues a 1024-token cached prefix; request 1 is a short plain prefill.
    w = planted_workload(
        [1024, 128],
        [2048, 128],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        fraction=0.05,
        margin=3.0,
        dtype=torch.float32,
        seed=2,
    )
    dense = dense_attention(w.q, w.k_cache, w.v_cache, w.batch)
    stats = compute_block_statistics(w.k_cache, w.v_cache, w.batch)
    for alpha in (0.05, 0.1, 0.2):
        cfg = SelectionConfig(alpha=alpha, min_sparse_kv_len=0, sink_tokens=128, window_tokens=128)
        index = build_block_index(w.q, w.k_cache, w.batch, config=cfg, statistics=stats)
        assert index.density(w.batch) < 0.5
        plan = build_correction_plan(index, stats, w.batch)
        dropped = sparse_attention(w.q, w.k_cache, w.v_cache, w.batch, index)
        corrected = corrected_attention(w.q, w.k_cache, w.v_cache, w.batch, index, plan)
        err_dropped = float((dropped - dense).norm() / dense.norm())
        err_corrected = float((corrected - dense).norm() / dense.norm())
        assert err_corrected < 0.8 * err_dropped, f"alpha {alpha}: {err_corrected:.4f} vs {err_dropped:.4f}"
