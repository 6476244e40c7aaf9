"""Correction diagnostics: pruned mass share, covariance error estimate and the error report.

Expected values come from hand computation, from explicit fp64 row-by-row loops
over the contiguous tokens (``correction_testlib``), or from identities with the
attention references (kept mass = ``exp(lse_sparse - lse_dense)``).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from correction_testlib import make_paged, random_index

from fpv2.correction import (
    CorrectionErrorReport,
    build_correction_plan,
    compute_block_statistics,
    corrected_attention,
    correction_error_report,
    covariance_error_estimate,
    pruned_mass_share,
)
from fpv2.correction.diagnostics import pruned_block_counts, segment_coordinates, summarize, tile_norms
from fpv2.kernel import BlockIndex, PagedPrefillBatch
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.reference.fp8 import dequantize_cache, dequantize_queries, quantize_cache, quantize_queries
from fpv2.kernel.testing import planted_workload


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_sparse = pytest.mark.skipif(
    not _has("fpv2.kernel.reference.sparse"), reason="fpv2.kernel.reference.sparse is not in this fpv2-kernel yet"
)
needs_index = pytest.mark.skipif(not _has("fpv2.index"), reason="needs fpv2-index to select blocks")
F64 = torch.float64


# ----------------------------------------------------------------------------- helpers
def paged_from_tokens(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], seqlens_q: list[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, PagedPrefillBatch]:
    """Scatter per-request ``(kv_len, Hkv, d)`` tokens into a paged cache with a reversed page order."""
    seqlens_k = [k.shape[0] for k in keys]
    pages = [-(-n // page_size) for n in seqlens_k]
    num_pages = sum(pages)
    order = list(reversed(range(num_pages)))  # pages deliberately out of order
    table = torch.full((len(keys), max(pages)), -1, dtype=torch.int32)
    k_cache = torch.zeros(num_pages, page_size, *keys[0].shape[1:])
    v_cache = torch.zeros_like(k_cache)
    used = 0
    for b, kv_len in enumerate(seqlens_k):
        table[b, : pages[b]] = torch.tensor(order[used : used + pages[b]], dtype=torch.int32)
        used += pages[b]
        for i in range(kv_len):
            k_cache[table[b, i // page_size], i % page_size] = keys[b][i]
            v_cache[table[b, i // page_size], i % page_size] = values[b][i]
    cu = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    batch = PagedPrefillBatch(cu, torch.tensor(seqlens_k, dtype=torch.int32), table, page_size, num_pages)
    return q, k_cache, v_cache, batch


def explicit_rows(paged, segs, block_size):
    """fp64, row by row: yields (seg, out row, head, weights w_i = exp(s_i - m), visible token ids)."""
    g, d = paged.group, paged.q.shape[2]
    scale = 1.0 / math.sqrt(d)
    for seg in segs:
        keys = paged.keys[seg.request][:, seg.kv_head].double()
        for r in range(seg.row_begin, seg.row_end):
            pos, hq = r // g, seg.kv_head * g + r % g
            row = paged.starts[seg.request] + pos
            visible = torch.arange(seg.prefix + pos + 1)
            logits = keys[visible] @ paged.q[row, hq].double() * scale
            yield seg, row, hq, torch.exp(logits - logits.max()), visible


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Rank correlation (no ties expected in continuous errors)."""
    rx = torch.argsort(torch.argsort(x)).double()
    ry = torch.argsort(torch.argsort(y)).double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


# ----------------------------------------------------------------------------- pruned mass share
@pytest.mark.parametrize("group", [1, 2])
def test_mass_share_hand_computed_one_tile_two_blocks(group):
    # 8 queries at positions 8..15 over 16 keys in two blocks of 8; s = (q . k) * ln 2 = k[0] * ln 2.
    # Block 0 keys have exp(s) = 1 each (mass 8); block 1 keys exp(s) = 2, row r sees r + 1 of them.
    d, block = 64, 8
    q = torch.zeros(8, group, d)
    q[:, :, 0] = 1.0
    keys = torch.zeros(16, 1, d)
    keys[8:, 0, 0] = 1.0
    q, k_cache, _, batch = paged_from_tokens(q, [keys], [torch.zeros_like(keys)], [8], page_size=4)
    index = BlockIndex(
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),  # keep the diagonal block only: block 0 is pruned
        torch.tensor([0, 1], dtype=torch.int32),
        num_kv_heads=1,
        group=group,
        tile_size=8 * group,
        block_size=block,
    )
    share = pruned_mass_share(q, k_cache, batch, index, softmax_scale=math.log(2.0), compute_dtype=F64)
    # Row at position 8 + r: 8 / (8 + 2 (r + 1)) = 4 / (5 + r).
    per_row = [4 / 5, 4 / 6, 4 / 7, 4 / 8, 4 / 9, 4 / 10, 4 / 11, 4 / 12]
    mean = sum(per_row) / 8
    assert share.num_segments == 1
    assert share.share_mean.item() == pytest.approx(mean, rel=1e-12)
    assert share.share_max.item() == pytest.approx(4 / 5, rel=1e-12)
    assert share.max_pruned_block_share.item() == pytest.approx(mean, rel=1e-12)
    assert share.max_block_share.item() == pytest.approx(max(mean, 1 - mean), rel=1e-12)
    assert share.uncorrectable_share_mean.item() == 0.0  # block 0 lies before the tile's first query
    assert (share.request.tolist(), share.kv_head.tolist(), share.tile.tolist()) == ([0], [0], [0])


@pytest.mark.parametrize(("group", "keep_diagonal"), [(1, True), (2, False), (4, True)])
def test_mass_share_matches_explicit_fp64(group, keep_diagonal):
    paged = make_paged([20, 0, 12], [150, 9, 12], num_q_heads=2 * group, num_kv_heads=2, page_size=16, seed=7)
    index, segs = random_index(paged, tile_size=16, block_size=8, keep_prob=0.3, seed=3, keep_diagonal=keep_diagonal)
    share = pruned_mass_share(paged.q, paged.k_cache, paged.batch, index, compute_dtype=F64)
    rows = {}
    for seg, _, _, w, visible in explicit_rows(paged, segs, 8):
        blocks = visible // 8
        mass = torch.zeros(int(blocks.max()) + 1, dtype=F64).index_add_(0, blocks, w) / w.sum()
        rows.setdefault(seg, []).append(mass)
    for s, seg in enumerate(segs):
        masses = rows[seg]
        nb = max(m.numel() for m in masses)
        per_block = torch.stack([torch.nn.functional.pad(m, (0, nb - m.numel())) for m in masses])  # (rows, nb)
        pruned = torch.tensor([j not in seg.kept for j in range(nb)])
        uncorrectable = pruned & (torch.arange(nb) >= seg.eligible(8))
        row_share = per_block[:, pruned].sum(dim=1)
        tile_blocks = per_block.mean(dim=0)
        assert share.share_mean[s].item() == pytest.approx(row_share.mean().item(), abs=1e-12)
        assert share.share_max[s].item() == pytest.approx(row_share.max().item(), abs=1e-12)
        assert share.uncorrectable_share_mean[s].item() == pytest.approx(
            per_block[:, uncorrectable].sum(dim=1).mean().item(), abs=1e-12
        )
        expected_block = tile_blocks[pruned].max().item() if pruned.any() else 0.0
        assert share.max_pruned_block_share[s].item() == pytest.approx(expected_block, abs=1e-12)
        assert share.max_block_share[s].item() == pytest.approx(tile_blocks.max().item(), abs=1e-12)
        assert (share.request[s].item(), share.kv_head[s].item(), share.tile[s].item()) == (
            seg.request,
            seg.kv_head,
            seg.tile,
        )
    if keep_diagonal:
        assert torch.all(share.uncorrectable_share_mean == 0)
    else:
        assert share.uncorrectable_share_mean.max() > 0


def test_mass_share_zero_for_dense_index_and_inside_unit_interval_for_sparse():
    paged = make_paged([40, 24], [200, 24], num_q_heads=4, num_kv_heads=2, page_size=16, seed=1)
    dense_index, _ = random_index(paged, tile_size=16, block_size=8, keep_prob=1.0, seed=0)
    dense = pruned_mass_share(paged.q, paged.k_cache, paged.batch, dense_index)
    assert torch.all(dense.share_mean == 0) and torch.all(dense.share_max == 0)
    assert torch.all(dense.max_pruned_block_share == 0)
    sparse_index, segs = random_index(paged, tile_size=16, block_size=8, keep_prob=0.3, seed=0)
    sparse = pruned_mass_share(paged.q, paged.k_cache, paged.batch, sparse_index)
    pruned = torch.tensor([any(j not in s.kept for j in range(s.eligible(8))) for s in segs])
    assert pruned.any()
    assert torch.all((sparse.share_mean[pruned] > 0) & (sparse.share_mean[pruned] < 1))
    assert torch.all(sparse.share_mean[~pruned] == 0)
    assert torch.all(sparse.share_max >= sparse.share_mean)
    expected_counts = [sum(j not in s.kept for j in range(((s.prefix + s.p_last) // 8) + 1)) for s in segs]
    assert pruned_block_counts(sparse_index, paged.batch).tolist() == expected_counts


@needs_sparse
def test_mass_share_equals_one_minus_kept_mass_at_8k():
    # Kept share of a row is exp(lse_sparse - lse_dense): an identity with the two attention references.
    from fpv2.kernel.reference.sparse import sparse_attention

    w = planted_workload(
        [8192], [8192], num_q_heads=1, num_kv_heads=1, head_dim=64, page_size=16, margin=3.0, dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(0)
    nb, ntiles = 64, 64
    offsets, blocks = [0], []
    for t in range(ntiles):  # keep the diagonal band and a random third of the earlier blocks
        last = (t * 128 + 127) // 128
        kept = sorted({j for j in range(last) if torch.rand(1, generator=gen).item() < 0.3} | {t, last})
        blocks += [j for j in kept if j < nb]
        offsets.append(len(blocks))
    index = BlockIndex(
        torch.tensor(offsets, dtype=torch.int32),
        torch.tensor(blocks, dtype=torch.int32),
        torch.tensor([0, ntiles], dtype=torch.int32),
        num_kv_heads=1,
        group=1,
    )
    share = pruned_mass_share(w.q, w.k_cache, w.batch, index)
    _, lse_dense = dense_attention(w.q, w.k_cache, w.v_cache, w.batch, return_lse=True)
    _, lse_sparse = sparse_attention(w.q, w.k_cache, w.v_cache, w.batch, index, return_lse=True)
    row_share = (1 - torch.exp(lse_sparse - lse_dense)).view(ntiles, 128).double()
    torch.testing.assert_close(share.share_mean.double(), row_share.mean(dim=1), rtol=0, atol=2e-5)
    torch.testing.assert_close(share.share_max.double(), row_share.max(dim=1).values, rtol=0, atol=2e-5)
    assert share.summary()["max"] > 0.05


def test_mass_share_fp8_uses_descales():
    paged = make_paged([24], [90], num_q_heads=4, num_kv_heads=2, page_size=16, seed=2)
    k_cache = torch.nan_to_num(paged.k_cache)  # spare slots hold NaN, which would poison the amax
    index, _ = random_index(paged, tile_size=16, block_size=8, keep_prob=0.4, seed=1)
    q8, q_descale = quantize_queries(paged.q, paged.batch, 2)
    k8, k_descale = quantize_cache(k_cache, paged.batch)
    got = pruned_mass_share(q8, k8, paged.batch, index, compute_dtype=F64, q_descale=q_descale, k_descale=k_descale)
    q_real = dequantize_queries(q8, q_descale, paged.batch)
    k_real = dequantize_cache(k8, k_descale)
    want = pruned_mass_share(q_real, k_real, paged.batch, index, compute_dtype=F64)
    # Dequantising in fp32 rounds q * descale once; the FP8 path multiplies in fp64.
    torch.testing.assert_close(got.share_mean, want.share_mean, rtol=1e-6, atol=1e-9)
    assert want.share_mean.max() > 0
    with pytest.raises(ValueError, match="q_descale is required"):
        pruned_mass_share(q8, k8, paged.batch, index)


def test_summary_and_bad_arguments():
    values = torch.linspace(0, 1, 21, dtype=F64)
    assert summarize(values) == pytest.approx({"mean": 0.5, "p50": 0.5, "p95": 0.95, "max": 1.0})
    assert all(math.isnan(v) for v in summarize(torch.zeros(0)).values())
    paged = make_paged([20], [40], num_q_heads=4, num_kv_heads=2, seed=0)
    index, _ = random_index(paged, tile_size=16, block_size=8, keep_prob=0.5, seed=0)
    share = pruned_mass_share(paged.q, paged.k_cache, paged.batch, index)
    assert share.summary("share_max") == summarize(share.share_max)
    with pytest.raises(ValueError, match="field must be one of"):
        share.summary("nope")
    with pytest.raises(TypeError, match="index must be a BlockIndex"):
        pruned_mass_share(paged.q, paged.k_cache, paged.batch, None)
    with pytest.raises(TypeError, match="compute_dtype"):
        pruned_mass_share(paged.q, paged.k_cache, paged.batch, index, compute_dtype=torch.bfloat16)
    other_group, _ = random_index(
        make_paged([20], [40], num_q_heads=2, num_kv_heads=2, seed=0), tile_size=16, block_size=8, keep_prob=0.5, seed=0
    )
    with pytest.raises(ValueError, match="GQA group"):
        pruned_mass_share(paged.q, paged.k_cache, paged.batch, other_group)
    stats = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        covariance_error_estimate(paged.q, paged.k_cache, paged.v_cache, paged.batch, index, stats)


# ----------------------------------------------------------------------------- covariance estimate
def test_covariance_term_matches_explicit_definition():
    paged = make_paged([20, 12], [150, 12], num_q_heads=4, num_kv_heads=2, page_size=16, seed=4)
    index, segs = random_index(paged, tile_size=16, block_size=8, keep_prob=0.3, seed=5)
    stats = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=8)
    est = covariance_error_estimate(paged.q, paged.k_cache, paged.v_cache, paged.batch, index, stats, compute_dtype=F64)
    expected = torch.zeros_like(est.covariance_error)
    for seg, row, hq, w, _ in explicit_rows(paged, segs, 8):
        values = paged.values[seg.request][:, seg.kv_head].double()
        total = torch.zeros(values.shape[1], dtype=F64)
        for j in range(seg.eligible(8)):
            if j in seg.kept:
                continue
            wj, vj = w[8 * j : 8 * j + 8], values[8 * j : 8 * j + 8]
            # C_rJ = |B_J| * mean_i (w_ri - wbar_rJ) (v_i - vbar_J)
            total += 8 * ((wj - wj.mean())[:, None] * (vj - vj.mean(dim=0))).mean(dim=0)
        expected[row, hq] = -total / w.sum()
    assert expected.abs().max() > 1e-3
    torch.testing.assert_close(est.covariance_error, expected, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(est.predicted_error, expected, rtol=1e-9, atol=1e-12)
    # Per-tile norms and segment coordinates, recomputed from the explicit segment list.
    g = paged.group
    for s, seg in enumerate(segs):
        rows = torch.arange(seg.row_begin, seg.row_end)
        block = expected[paged.starts[seg.request] + rows // g, seg.kv_head * g + rows % g]
        assert est.tile_covariance_error[s].item() == pytest.approx(block.norm().item(), rel=1e-9, abs=1e-14)
    request, kv_head, tile = segment_coordinates(index)
    assert list(zip(request.tolist(), kv_head.tolist(), tile.tolist())) == [
        (s.request, s.kv_head, s.tile) for s in segs
    ]


@needs_sparse
@pytest.mark.parametrize("keep_diagonal", [True, False])
def test_error_terms_add_up_to_corrected_minus_dense(keep_diagonal):
    paged = make_paged([20, 0, 12], [150, 9, 12], num_q_heads=4, num_kv_heads=2, page_size=16, seed=8)
    index, _ = random_index(paged, tile_size=16, block_size=8, keep_prob=0.3, seed=2, keep_diagonal=keep_diagonal)
    stats = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=8)
    plan = build_correction_plan(index, stats, paged.batch)
    est = covariance_error_estimate(paged.q, paged.k_cache, paged.v_cache, paged.batch, index, stats, compute_dtype=F64)
    args = (paged.q, paged.k_cache, paged.v_cache, paged.batch)
    actual = corrected_attention(*args, index, plan, compute_dtype=F64) - dense_attention(*args, compute_dtype=F64)
    assert actual.abs().max() > 0.05
    torch.testing.assert_close(est.total_error, actual, rtol=0, atol=1e-6)
    assert est.mass_error.abs().max() > 0
    if keep_diagonal:
        assert torch.all(est.uncorrected_error == 0)
    else:
        assert est.uncorrected_error.abs().max() > 1e-3


@needs_sparse
def test_block_constant_keys_and_values_make_the_correction_exact():
    gen = torch.Generator().manual_seed(3)
    block, hkv, d = 8, 2, 64
    keys, values = [], []
    for kv_len in (70, 24):
        nb = -(-kv_len // block)
        keys.append(torch.randn(nb, hkv, d, generator=gen).repeat_interleave(block, dim=0)[:kv_len])
        values.append(torch.randn(nb, hkv, d, generator=gen).repeat_interleave(block, dim=0)[:kv_len])
    q = 2.0 * torch.randn(40, 4, d, generator=gen)
    q, k_cache, v_cache, batch = paged_from_tokens(q, keys, values, [24, 16], page_size=4)
    paged = make_paged([24, 16], [70, 24], num_q_heads=4, num_kv_heads=2, seed=0)  # same geometry, for the index
    index, _ = random_index(paged, tile_size=16, block_size=block, keep_prob=0.25, seed=4)
    stats = compute_block_statistics(k_cache, v_cache, batch, block_size=block)
    est = covariance_error_estimate(q, k_cache, v_cache, batch, index, stats, compute_dtype=F64)
    share = pruned_mass_share(q, k_cache, batch, index, compute_dtype=F64)
    assert share.share_mean.max() > 0.05  # the pruned blocks matter, yet the correction is exact
    assert est.covariance_error.abs().max() < 1e-12
    assert est.tile_covariance_error.max() < 1e-12
    assert est.mass_error.abs().max() < 1e-6  # pooled values are stored in fp32
    plan = build_correction_plan(index, stats, batch)
    dense = dense_attention(q, k_cache, v_cache, batch, compute_dtype=F64)
    corrected = corrected_attention(q, k_cache, v_cache, batch, index, plan, compute_dtype=F64)
    torch.testing.assert_close(corrected, dense, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- planted workloads
@needs_sparse
@needs_index
@pytest.mark.parametrize("drift_tokens", [None, 256.0], ids=["planted", "drifting"])
def test_predicted_error_tracks_actual_error_on_planted_workload(drift_tokens):
    from fpv2.index import SelectionConfig, build_block_index

    # margin 3: pruned blocks keep a few percent of the mass each; request 0 continues a 1024-token prefix.
    # The drifting background makes pooled keys differ between blocks (the estimate's harder case).
    w = planted_workload(
        [1024],
        [2048],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        margin=3.0,
        fraction=0.05,
        seed=3,
        drift_tokens=drift_tokens,
    )
    stats = compute_block_statistics(w.k_cache, w.v_cache, w.batch)
    config = SelectionConfig(alpha=0.1, min_sparse_kv_len=0, sink_tokens=128, window_tokens=128)
    index = build_block_index(w.q, w.k_cache, w.batch, config=config, statistics=stats)
    report = correction_error_report(w.q, w.k_cache, w.v_cache, w.batch, index, stats, compute_dtype=F64)
    assert isinstance(report, CorrectionErrorReport)
    lossy = report.num_pruned_blocks > 0
    assert int(lossy.sum()) >= 10
    predicted, corrected, dropped = (
        x[lossy] for x in (report.predicted_error, report.corrected_error, report.dropped_error)
    )
    # Correlation across tiles, computed here with torch.
    p, c = predicted - predicted.mean(), corrected - corrected.mean()
    pearson = float((p * c).sum() / (p.norm() * c.norm()))
    assert pearson > 0.5, pearson
    assert spearman(predicted, corrected) > 0.5
    assert float((corrected < dropped).double().mean()) >= 0.8
    # Tiles that prune nothing are exact either way (up to rounding).
    assert report.corrected_error[~lossy].max() < 1e-10 and report.predicted_error[~lossy].max() == 0
    # The report's own helpers agree with the computation above.
    assert report.correlation()["pearson"] > 0.5
    assert report.improved_fraction() == pytest.approx(float((corrected < dropped).double().mean()))
    dense = dense_attention(w.q, w.k_cache, w.v_cache, w.batch, compute_dtype=F64)
    torch.testing.assert_close(report.dense_norm, tile_norms(dense, w.batch, index))
    assert report.summary()["corrected"]["mean"] < report.summary()["dropped"]["mean"]


def graded_workload(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedPrefillBatch]:
    """Planted inputs whose key blocks carry graded logit shifts in [0, 4], so every alpha has blocks near its cut."""
    gen = torch.Generator().manual_seed(seed)
    q_len, kv_len, hkv, group, d, block = 1024, 2048, 2, 2, 64, 128
    direction = torch.randn(hkv, d, generator=gen)
    direction /= direction.norm(dim=1, keepdim=True)
    shift = 4.0 * torch.rand(hkv, kv_len // block, generator=gen)  # per (KV head, block) logit shift
    keys = torch.randn(kv_len, hkv, d, generator=gen) + shift.T.repeat_interleave(block, 0)[:, :, None] * direction
    values = torch.randn(kv_len, hkv, d, generator=gen)
    # q . direction = sqrt(d) turns the key shift into the same logit shift after the 1/sqrt(d) scale.
    q = torch.randn(q_len, hkv * group, d, generator=gen) + math.sqrt(d) * direction.repeat_interleave(group, 0)
    batch = PagedPrefillBatch.contiguous([q_len], [kv_len], page_size=16)
    return q, keys.view(-1, 16, hkv, d), values.view(-1, 16, hkv, d), batch


@needs_index
@pytest.mark.parametrize("alpha", [0.05, 0.1, 0.2])
def test_max_threshold_caps_each_pruned_block_share_near_alpha(alpha):
    from fpv2.index import SelectionConfig, build_block_index

    q, k_cache, _, batch = graded_workload(seed=0)
    config = SelectionConfig(alpha=alpha, min_sparse_kv_len=0, sink_tokens=128, window_tokens=128)
    index = build_block_index(q, k_cache, batch, config=config)
    share = pruned_mass_share(q, k_cache, batch, index, compute_dtype=F64)
    pruned = share.max_pruned_block_share > 0
    assert int(pruned.sum()) >= 10
    ratio = share.max_pruned_block_share[pruned] / share.max_block_share[pruned]
    # The selector ranks pooled-key energies; true block masses follow them up to the within-block
    # (Jensen) spread, hence "about alpha": allow a factor 2 over the stated cap.
    assert float(ratio.max()) <= 2 * alpha, float(ratio.max() / alpha)
    # The cap binds: typical pruned blocks sit within a few times alpha of it, not far below.
    assert float(ratio.median()) >= 0.25 * alpha


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_diagnostics_on_gpu_match_cpu():
    paged = make_paged([40, 24], [200, 24], num_q_heads=4, num_kv_heads=2, page_size=16, seed=6)
    index, _ = random_index(paged, tile_size=16, block_size=8, keep_prob=0.3, seed=6)
    stats = compute_block_statistics(paged.k_cache, paged.v_cache, paged.batch, block_size=8)
    cpu_share = pruned_mass_share(paged.q, paged.k_cache, paged.batch, index, compute_dtype=F64)
    cpu_est = covariance_error_estimate(
        paged.q, paged.k_cache, paged.v_cache, paged.batch, index, stats, compute_dtype=F64
    )
    dev = torch.device("cuda")
    index_dev = BlockIndex(
        index.offsets.to(dev), index.blocks.to(dev), index.tile_offsets.to(dev), 2, 2, tile_size=16, block_size=8
    )
    batch_dev = paged.batch.to(dev)
    stats_dev = compute_block_statistics(paged.k_cache.to(dev), paged.v_cache.to(dev), batch_dev, block_size=8)
    share = pruned_mass_share(paged.q.to(dev), paged.k_cache.to(dev), batch_dev, index_dev, compute_dtype=F64)
    est = covariance_error_estimate(
        paged.q.to(dev),
        paged.k_cache.to(dev),
        paged.v_cache.to(dev),
        batch_dev,
        index_dev,
        stats_dev,
        compute_dtype=F64,
    )
    torch.testing.assert_close(share.share_mean.cpu(), cpu_share.share_mean)
    torch.testing.assert_close(est.covariance_error.cpu(), cpu_est.covariance_error)
    torch.testing.assert_close(est.tile_mass_error.cpu(), cpu_est.tile_mass_error)
