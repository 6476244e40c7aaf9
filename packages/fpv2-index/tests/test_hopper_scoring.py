"""The Hopper (wgmma) scoring pass against the reference and the Triton pass (``FPV2_INDEX_SCORING``).

CPU tests check the switch: its modes, the reasons it gives for calls the kernel cannot serve, and that
``hopper`` refuses such calls with that reason instead of falling back silently. ``gpu`` tests (an sm_90
GPU and a library built with the Hopper code) run the kernel over a grid of head dims, dtypes, GQA groups,
block sizes, varlen batches with cached prefixes and rule settings: its index must equal the reference's
and the Triton pass's except at blocks whose reference energy ratio lies within rounding of ``alpha``, also
for logits hundreds of log2 units from zero (the kernel's exact-offset path);
keep bits left in a reused workspace by an earlier call must not leak into a later one; the call makes no
host sync.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_index import EXTREME_LOGIT_CASES, _compare, _reference_ratios, _shift_logits

from fpv2.index.config import SelectionConfig
from fpv2.index.reference import select_blocks
from fpv2.index.triton import IndexWorkspace, pool_blocks_triton, select_blocks_triton
from fpv2.index.triton.hopper_scoring import (
    SCORING_ENV,
    device_scoring_reason,
    hopper_scoring_reason,
    scoring_mode,
    use_hopper_scoring,
)
from fpv2.kernel.contracts import PagedPrefillBatch
from fpv2.kernel.reference.pooling import pool_blocks
from fpv2.kernel.testing import planted_workload

gpu = pytest.mark.gpu


def _hopper_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    probe = torch.zeros(1, 8, 128, dtype=torch.bfloat16, device="cuda")
    return hopper_scoring_reason(probe, SelectionConfig(), 128, 1, False)


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or _hopper_reason() is not None,
    reason="needs an sm_90 GPU and libfpv2_kernel built with the Hopper code",
)


# --------------------------------------------------------------------------- the switch (CPU)
@pytest.mark.parametrize(
    ("value", "mode"), [(None, "auto"), ("", "auto"), ("TRITON", "triton"), (" hopper ", "hopper")]
)
def test_scoring_mode_reads_the_environment(monkeypatch, value, mode) -> None:
    if value is None:
        monkeypatch.delenv(SCORING_ENV, raising=False)
    else:
        monkeypatch.setenv(SCORING_ENV, value)
    assert scoring_mode() == mode


def test_unknown_scoring_mode_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(SCORING_ENV, "cutlass")
    with pytest.raises(ValueError, match="FPV2_INDEX_SCORING='cutlass'"):
        scoring_mode()


def test_reasons_name_what_the_kernel_cannot_serve() -> None:
    cpu = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    assert "CUDA" in hopper_scoring_reason(cpu, SelectionConfig(), 128, 8, False)
    if torch.cuda.is_available():
        q = cpu.cuda()
        assert "float32" in hopper_scoring_reason(q.float(), SelectionConfig(), 128, 8, False)
        assert "head dims" in hopper_scoring_reason(q[..., :96], SelectionConfig(), 96, 8, False)
        assert "probe_stride=2" in hopper_scoring_reason(q, SelectionConfig(probe_stride=2), 128, 8, False)
        assert "16385 key blocks" in hopper_scoring_reason(q, SelectionConfig(), 128, 16385, False)


def test_hopper_mode_refuses_instead_of_falling_back(monkeypatch) -> None:
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)  # CPU queries: never served
    monkeypatch.setenv(SCORING_ENV, "hopper")
    with pytest.raises(ValueError, match="cannot serve this call: the queries are not on a CUDA device"):
        use_hopper_scoring(q, SelectionConfig(), 128, 8, False)
    monkeypatch.setenv(SCORING_ENV, "auto")
    assert use_hopper_scoring(q, SelectionConfig(), 128, 8, False) is False
    monkeypatch.setenv(SCORING_ENV, "triton")
    assert use_hopper_scoring(q, SelectionConfig(), 128, 8, False) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_device_reason_without_cuda() -> None:
    assert device_scoring_reason() == "no CUDA device is visible to torch"
    assert device_scoring_reason(0) == "no CUDA device is visible to torch"


def test_the_default_falls_back_where_the_kernel_cannot_serve(monkeypatch) -> None:
    monkeypatch.delenv(SCORING_ENV, raising=False)
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)  # CPU queries: the Triton pass, no error
    assert use_hopper_scoring(q, SelectionConfig(), 128, 8, False) is False
    assert use_hopper_scoring(q, SelectionConfig(probe_stride=2), 128, 8, False) is False


@gpu
@needs_hopper
def test_the_default_takes_the_hopper_kernel_on_sm90(monkeypatch) -> None:
    monkeypatch.delenv(SCORING_ENV, raising=False)
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert use_hopper_scoring(q, SelectionConfig(), 128, 8, False) is True
    assert use_hopper_scoring(q, SelectionConfig(probe_stride=2), 128, 8, False) is False


# --------------------------------------------------------------------------- the kernel (GPU)
GRID = [
    # (q_lens, kv_lens, Hq, Hkv, d, dtype, page_size, config overrides)
    pytest.param([4096], [4096], 32, 8, 128, torch.bfloat16, 1, {}, id="4k-g4-d128-bf16"),
    pytest.param(
        [3000, 0, 1500, 700],
        [9000, 500, 1500, 12000],
        28,
        4,
        128,
        torch.bfloat16,
        16,
        {"min_sparse_kv_len": 1024},
        id="varlen-prefix-g7",
    ),
    pytest.param([2500, 1200], [2500, 7000], 16, 16, 64, torch.float16, 64, {"window_tokens": 0}, id="g1-d64-fp16"),
    pytest.param(
        [1000, 3333],
        [5000, 3333],
        64,
        8,
        64,
        torch.bfloat16,
        128,
        {"sink_tokens": 0, "dense_tail_tiles": 0},
        id="g8-d64-no-forced",
    ),
    pytest.param([2049], [10000], 32, 8, 128, torch.float16, 1, {"block_size": 64, "alpha": 0.02}, id="bk64-fp16"),
    pytest.param(
        [777, 5], [20000, 6], 32, 4, 128, torch.bfloat16, 16, {"dense_tail_tiles": 3, "alpha": 0.3}, id="short-chunks"
    ),
]


def _inputs(q_lens, kv_lens, hq, hkv, d, dtype, page_size, seed):
    torch.manual_seed(seed)
    return planted_workload(
        q_lens, kv_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size, dtype=dtype,
        device="cuda",
    )  # fmt: skip


@gpu
@needs_hopper
@pytest.mark.parametrize(("q_lens", "kv_lens", "hq", "hkv", "d", "dtype", "page_size", "overrides"), GRID)
def test_hopper_scoring_matches_reference_and_triton(
    monkeypatch, record_property, q_lens, kv_lens, hq, hkv, d, dtype, page_size, overrides
) -> None:
    w = _inputs(q_lens, kv_lens, hq, hkv, d, dtype, page_size, seed=len(q_lens) * 1000 + d)
    config = SelectionConfig(**{"min_sparse_kv_len": 0, **overrides})
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=config.block_size)
    monkeypatch.setenv(SCORING_ENV, "hopper")
    got = select_blocks_triton(w.q, w.batch, stats, config=config)
    monkeypatch.setenv(SCORING_ENV, "triton")
    triton_index = select_blocks_triton(w.q, w.batch, stats, config=config)
    ref = select_blocks(w.q, w.batch, stats, config=config)
    ratios = _reference_ratios(w.q, w.batch, stats, config)
    flips, scored = _compare(got, ref, ratios, config.alpha)
    flips_triton, _ = _compare(got, triton_index, ratios, config.alpha)
    record_property("near_threshold_flips", flips)
    assert scored > 0, "the case scores nothing: it would not test the kernel"
    assert flips <= max(2, scored // 1000) and flips_triton <= max(2, scored // 1000)


@gpu
@needs_hopper
def test_hopper_scoring_32k_planted_equals_triton(monkeypatch) -> None:
    w = _inputs([32768], [32768], 32, 8, 128, torch.bfloat16, 1, seed=7)
    config = SelectionConfig()
    stats = pool_blocks_triton(w.k_cache, None, w.batch)
    monkeypatch.setenv(SCORING_ENV, "hopper")
    got = select_blocks_triton(w.q, w.batch, stats, config=config, exact_nnz=True)
    monkeypatch.setenv(SCORING_ENV, "triton")
    expected = select_blocks_triton(w.q, w.batch, stats, config=config, exact_nnz=True)
    assert torch.equal(got.tile_offsets, expected.tile_offsets)
    nb = 32768 // config.block_size
    differ = int((got.to_dense_mask(nb) ^ expected.to_dense_mask(nb)).sum())
    kept = int(expected.offsets[-1])
    print(f"32K planted: {differ} (segment, block) pairs differ of {kept} kept")
    assert differ <= kept // 10000


#: (head dim, dtype) of the extreme-logit cases: each of the kernel's instances but fp16 at d = 64 (it differs
#: from these only in the element type and the head dim, which the cases cover between them).
EXTREME_LOGIT_CONFIGS = [
    pytest.param(128, torch.bfloat16, id="bf16-d128"),
    pytest.param(128, torch.float16, id="fp16-d128"),
    pytest.param(64, torch.bfloat16, id="bf16-d64"),
]


@gpu
@needs_hopper
@pytest.mark.parametrize(("d", "dtype"), EXTREME_LOGIT_CONFIGS)
@pytest.mark.parametrize(("shift_log2", "block"), EXTREME_LOGIT_CASES)
def test_hopper_scoring_extreme_logits_match_reference(monkeypatch, shift_log2, block, d, dtype) -> None:
    """Logits far outside the usual range take the kernel's exact-offset path; the index must not move.

    KV head 0 gets the shift, KV head 1 is the control. 2,048 queries after a 14,336-token prefix: every tile
    scores two steps of 64 keys, so a late key meets the running maximum of the first step.
    """
    w = _inputs([2048], [16384], 8, 2, d, dtype, 16, seed=11)
    _shift_logits(w, 0, shift_log2, block)
    config = SelectionConfig(min_sparse_kv_len=0)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=config.block_size)
    monkeypatch.setenv(SCORING_ENV, "hopper")
    got = select_blocks_triton(w.q, w.batch, stats, config=config)
    ref = select_blocks(w.q, w.batch, stats, config=config)
    ratios = _reference_ratios(w.q, w.batch, stats, config)
    flips, scored = _compare(got, ref, ratios, config.alpha)
    assert scored > 0, "the case scores nothing: it would not test the kernel"
    assert flips <= max(2, scored // 1000)
    if block is not None:  # the late key dominates KV head 0's tiles
        assert bool(got.to_dense_mask(ratios.shape[1])[: got.num_segments // 2, block].all())


@gpu
@needs_hopper
def test_reused_workspace_keeps_no_stale_bits(monkeypatch) -> None:
    monkeypatch.setenv(SCORING_ENV, "hopper")
    w = _inputs([3000, 1200], [9000, 5000], 32, 8, 128, torch.bfloat16, 16, seed=3)
    stats = pool_blocks(w.k_cache, None, w.batch)
    workspace = IndexWorkspace()
    everything = SelectionConfig(alpha=1e-30, min_sparse_kv_len=0)
    sparse = SelectionConfig(alpha=0.2, min_sparse_kv_len=0)
    select_blocks_triton(w.q, w.batch, stats, config=everything, workspace=workspace)  # every bit set
    again = select_blocks_triton(w.q, w.batch, stats, config=sparse, workspace=workspace, exact_nnz=True)
    fresh = select_blocks_triton(w.q, w.batch, stats, config=sparse, exact_nnz=True)
    assert torch.equal(again.offsets, fresh.offsets) and torch.equal(again.blocks, fresh.blocks)
    assert int(fresh.offsets[-1]) < int(select_blocks_triton(w.q, w.batch, stats, config=everything).offsets[-1])


@gpu
@needs_hopper
def test_hopper_scoring_makes_no_host_sync(monkeypatch) -> None:
    monkeypatch.setenv(SCORING_ENV, "hopper")
    w = _inputs([2048, 1000], [6000, 1000], 32, 8, 128, torch.bfloat16, 1, seed=5)
    config = SelectionConfig(min_sparse_kv_len=0)
    batch = PagedPrefillBatch(
        w.batch.cu_seqlens_q, w.batch.seqlens_k, w.batch.page_table, w.batch.page_size, w.batch.num_pages
    )
    _ = batch.host
    ws = IndexWorkspace()
    stats = pool_blocks_triton(w.k_cache, w.v_cache, batch)
    expected = select_blocks_triton(w.q, batch, stats, config=config, workspace=ws)  # loads the library
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        index = select_blocks_triton(w.q, batch, stats, config=config, workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    nnz = int(expected.offsets[-1])
    assert torch.equal(index.offsets, expected.offsets)
    assert torch.equal(index.blocks[:nnz], expected.blocks[:nnz])
