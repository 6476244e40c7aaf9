"""GPU checks of the pipeline and the bench command (run by scripts/device_check.sh)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hopper_runs_here, same_output_in_and_out_of_inference_mode

from fpv2.index import SelectionConfig
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.testing import planted_workload
from fpv2.serving import SparsePrefillPipeline
from fpv2.serving.cli import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def test_pipeline_on_cuda_matches_dense_and_times_with_events():
    wl = planted_workload(
        [4096, 2048], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16, device="cuda"
    )
    ref = dense_attention(wl.q.float(), wl.k_cache.float(), wl.v_cache.float(), wl.batch)
    dense = SparsePrefillPipeline(strategy="dense", correction=False)(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert dense.out.device.type == "cuda" and dense.out.dtype == torch.bfloat16
    assert rel_err(dense.out, ref) < 1e-2
    sparse = SparsePrefillPipeline(SelectionConfig(min_sparse_kv_len=0))(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert sparse.index.density(wl.batch) < 1.0
    assert rel_err(sparse.out, ref) < 0.1
    t = sparse.timings
    assert t.index_ms > 0 and t.attention_ms > 0 and t.correction_ms >= 0


def test_bench_on_cuda_writes_records_with_baselines(tmp_path, capsys):
    args = ["bench", "-L", "4096", "--q-heads", "8", "--kv-heads", "2", "--head-dim", "128", "--dtype", "bf16"]
    args += ["--device", "cuda", "--repeats", "3", "--warmup", "1", "--min-sparse-kv-len", "0", "--no-progress"]
    assert main([*args, "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "summary.json").read_text())
    impls = {r["impl"] for r in summary}
    # auto chooses per call (on an H200 the Hopper kernel, page size 1 included; elsewhere Triton): the dense
    # and sparse rows name the backend that ran, the same one.
    ran = {impl.split("/", 1)[1] for impl in impls if impl.startswith(("fpv2-dense/", "fpv2-sparse/"))}
    assert len(ran) == 1 and ran <= {"hopper", "triton"}, impls
    backend = ran.pop()
    assert {f"fpv2-dense/{backend}", f"fpv2-sparse/{backend}", "fpv2-index", "torch-sdpa-flash"} <= impls
    assert all(r["gpu"] != "cpu" and r["ms"] > 0 for r in summary)
    # Host-ahead GPU times on every row, stage split on the pipeline rows; the GPU-only time of a pipeline
    # call cannot exceed the eager one by more than run-to-run noise (it drops the host's gaps).
    assert all(isinstance(r["gpu_ms"], float) and r["gpu_ms"] > 0 for r in summary), summary
    for r in summary:
        if r["impl"].startswith("fpv2-sparse/"):
            assert r["gpu_index_ms"] > 0 and r["gpu_attention_ms"] > 0
            assert r["gpu_ms"] <= 1.25 * r["ms"], r
    for r in summary:
        if r["impl"].startswith("torch-sdpa"):
            assert r["rel_err"] < 2e-2, r
    assert (next(tmp_path.glob("*.png"))).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("page_size", [1, 128])
def test_pipeline_on_cuda_runs_in_and_out_of_inference_mode(page_size):
    # vLLM runs the forward pass under torch.inference_mode, whose tensors keep no version counter: the
    # Triton pooling read pooled_k._version there and failed (seen on the H200, 2026-12-04).
    w = planted_workload(
        [4096], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=page_size, dtype=torch.bfloat16, device="cuda"
    )
    out = same_output_in_and_out_of_inference_mode(SparsePrefillPipeline(SelectionConfig(min_sparse_kv_len=0)), w)
    want = dense_attention(w.q, w.k_cache, w.v_cache, w.batch)
    assert float((out.float() - want).norm() / want.norm()) < 0.1


@pytest.mark.hopper
@pytest.mark.skipif(not hopper_runs_here(), reason="needs an sm_90 GPU and the native Hopper kernel")
@pytest.mark.parametrize("correction", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_hopper_pipeline_runs_on_the_copy_the_pooling_made(monkeypatch, page_size, correction):
    # At small pages the Hopper backend copies K/V into tile pages; the pooling kernel now writes that copy.
    from fpv2.serving.backends import HopperBackend

    monkeypatch.setenv("FPV2_HOPPER_REPACK", "1")  # always through the copy at pages below 128 tokens
    w = planted_workload(
        [3000, 700], [3000, 1500], num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=page_size,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    config = SelectionConfig(min_sparse_kv_len=0)
    pipeline = SparsePrefillPipeline(config, correction=correction, backend="hopper")
    got = pipeline(w.q, w.k_cache, w.v_cache, w.batch)
    assert pipeline.backend.last_kv_layout == "tile-repack" and pipeline.backend.last_copy_pooled
    # The same call with the backend's own copy launch: the same tile pages, so the same bits.
    monkeypatch.setattr(HopperBackend, "tile_copies_for", lambda self, *args: None)
    own = SparsePrefillPipeline(config, correction=correction, backend="hopper")
    want = own(w.q, w.k_cache, w.v_cache, w.batch)
    assert own.backend.last_kv_layout == "tile-repack" and own.backend.last_copy_pooled is False
    assert torch.equal(got.out, want.out)
    ref = dense_attention(w.q, w.k_cache, w.v_cache, w.batch)
    assert rel_err(got.out, ref) < 0.1


@pytest.mark.hopper
@pytest.mark.skipif(not hopper_runs_here(), reason="needs an sm_90 GPU and the native Hopper kernel")
@pytest.mark.parametrize("page_size", [1, 16])
def test_hopper_chunks_run_on_the_carried_tile_pages(monkeypatch, page_size):
    # The chunk-aware pipeline keeps the prompt in tile pages; every chunk's call runs on them.
    from fpv2.serving.backends import HopperBackend
    from fpv2.serving.chunked import ChunkedPrefillPipeline

    monkeypatch.delenv("FPV2_HOPPER_REPACK", raising=False)
    w = planted_workload(
        [6000], [6500], num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=page_size, dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip
    config = SelectionConfig(min_sparse_kv_len=0)
    pipeline = ChunkedPrefillPipeline(config, backend="hopper")
    layouts = []
    run = pipeline.backend.run

    def recording_run(*args, **kwargs):
        out = run(*args, **kwargs)
        layouts.append((pipeline.backend.last_kv_layout, kwargs.get("tile_copies") is not None))
        return out

    monkeypatch.setattr(pipeline.backend, "run", recording_run)
    from fpv2.kernel.triton import tile_repack

    own_copies = []
    copy = tile_repack.repack_into_tile_pages
    monkeypatch.setattr(
        tile_repack, "repack_into_tile_pages", lambda *args, **kwargs: own_copies.append(1) or copy(*args, **kwargs)
    )
    got = pipeline.run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=1024)
    assert layouts == [("tile-repack", True)] * 6
    assert own_copies == []  # every chunk's pooling launch filled its pages
    # The copy in a launch of its own: the same pages, so the same bits.
    monkeypatch.setenv("FPV2_CHUNKED_FUSED_TILE_COPY", "0")
    unfused = ChunkedPrefillPipeline(config, backend="hopper").run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=1024)
    assert len(own_copies) == 6 and torch.equal(got.out, unfused.out)
    monkeypatch.delenv("FPV2_CHUNKED_FUSED_TILE_COPY")
    # Without the carried pages each chunk copies its whole KV (forced): the same tile rows, so the same bits.
    monkeypatch.setattr(HopperBackend, "carries_tile_pages", lambda self, *args: False)
    monkeypatch.setenv("FPV2_HOPPER_REPACK", "1")
    per_call = ChunkedPrefillPipeline(config, backend="hopper")
    want = per_call.run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=1024)
    assert per_call.backend.last_kv_layout == "tile-repack" and per_call.backend.last_copy_pooled is False
    assert torch.equal(got.out, want.out)
    ref = dense_attention(w.q, w.k_cache, w.v_cache, w.batch)
    assert rel_err(got.out, ref) < 0.1
