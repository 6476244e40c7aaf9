"""The sparse prefill pipeline against the independent dense reference."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import same_output_in_and_out_of_inference_mode

from fpv2.index import SelectionConfig
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.reference.fp8 import quantize_cache, quantize_queries
from fpv2.kernel.testing import planted_workload
from fpv2.serving import PrefillResult, SparsePrefillPipeline, StageTimings

# Small sinks and windows so that a 2K-token request has blocks to prune.
SPARSE = SelectionConfig(alpha=0.1, sink_tokens=128, window_tokens=128, min_sparse_kv_len=0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module")
def planted():
    """One request of 2048 tokens, 4 query heads over 2 KV heads, paged by 16, fp32."""
    wl = planted_workload(
        [2048], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, fraction=0.05, seed=1, dtype=torch.float32
    )
    ref = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    return wl, ref


def test_dense_strategy_equals_dense_attention_varlen_prefix():
    # Two requests, the second on top of a 200-token cached prefix, page size 16: every
    # visible block kept, so the pipeline must reproduce dense causal attention.
    wl = planted_workload(
        [300, 500], [300, 700], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32, seed=3
    )
    ref = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    for correction in (False, True):
        pipe = SparsePrefillPipeline(strategy="dense", correction=correction, backend="reference")
        result = pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
        assert isinstance(result, PrefillResult)
        assert result.out.dtype == torch.float32 and result.out.shape == wl.q.shape
        assert result.index.density(wl.batch) == pytest.approx(1.0)
        torch.testing.assert_close(result.out, ref, rtol=1e-5, atol=1e-5)
        assert (result.plan is not None) == correction


def test_planted_workload_is_sparse_and_accurate(planted):
    wl, ref = planted
    result = SparsePrefillPipeline(SPARSE, backend="reference")(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    density = result.index.density(wl.batch)
    assert 0.0 < density < 0.8
    assert rel_err(result.out, ref) < 0.05
    # Every planted block must survive selection in the last tile of each KV head, which sees them all.
    last_tile = result.index.tile_offsets[1].item() - 1
    for h in range(2):
        kept = set(result.index.kept_blocks(0, h, last_tile))
        planted_ids = torch.nonzero(wl.planted_blocks[0][h]).flatten().tolist()
        assert set(planted_ids) <= kept


def test_correction_changes_output_and_reduces_error(planted):
    wl, ref = planted
    on = SparsePrefillPipeline(SPARSE, correction=True, backend="reference")(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    off = SparsePrefillPipeline(SPARSE, correction=False, backend="reference")(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert off.plan is None and on.plan is not None
    # The same selection, different outputs: the pruned blocks' mass is added back.
    assert torch.equal(on.index.blocks, off.index.blocks)
    assert (on.out - off.out).abs().max().item() > 1e-3
    assert rel_err(on.out, ref) < rel_err(off.out, ref)
    # One pooling serves the index and the correction.
    assert on.plan.statistics is on.statistics
    assert on.statistics.pooled_v is not None


def test_second_order_shift_adds_the_key_spread_and_lowers_the_error():
    """The drifting background (correlated keys): the shift states the pruned blocks' mass better."""
    wl = planted_workload([1024], [2048], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                          dtype=torch.float32, seed=3, drift_tokens=256.0)  # fmt: skip
    ref = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    results = {}
    for shift in ("mean", "second_order"):
        pipe = SparsePrefillPipeline(SPARSE, backend="reference", mass_shift=shift)
        results[shift] = pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
        assert results[shift].plan.mass_shift == shift and shift in repr(pipe)
    spread = results["second_order"].plan.key_spread
    assert spread is not None and spread.variance.shape == results["second_order"].statistics.pooled_k.shape[:2]
    assert torch.equal(results["mean"].index.blocks, results["second_order"].index.blocks)
    assert rel_err(results["second_order"].out, ref) < 0.85 * rel_err(results["mean"].out, ref)


def test_second_order_shift_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="needs correction=True"):
        SparsePrefillPipeline(SPARSE, correction=False, mass_shift="second_order")
    with pytest.raises(ValueError, match="mass_shift must be one of mean, second_order"):
        SparsePrefillPipeline(SPARSE, mass_shift="third_order")

    class MeanOnly:
        name = "mean-only"

        def available(self):
            return True, "here"

        def run(self, *args, **kwargs):
            raise AssertionError("not called")

    with pytest.raises(ValueError, match="backend 'mean-only' applies mass_shift 'mean' only"):
        SparsePrefillPipeline(SPARSE, backend=MeanOnly(), mass_shift="second_order")


def test_timings_are_per_stage_and_nonnegative(planted):
    wl, _ = planted
    result = SparsePrefillPipeline(SPARSE, backend="reference")(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    t = result.timings
    assert isinstance(t, StageTimings)
    assert min(t.index_ms, t.correction_ms, t.attention_ms) >= 0.0
    assert t.attention_ms > 0.0
    assert t.total_ms == pytest.approx(t.index_ms + t.correction_ms + t.attention_ms)
    assert result.timings is t  # resolved once


def test_fp8_inputs_give_bf16_output_close_to_fp32_dense():
    wl = planted_workload(
        [1024], num_q_heads=4, num_kv_heads=2, head_dim=64, fraction=0.05, seed=2, dtype=torch.bfloat16
    )
    ref = dense_attention(wl.q.float(), wl.k_cache.float(), wl.v_cache.float(), wl.batch)
    q8, qd = quantize_queries(wl.q, wl.batch, 2)
    k8, kd = quantize_cache(wl.k_cache, wl.batch)
    v8, vd = quantize_cache(wl.v_cache, wl.batch)
    pipe = SparsePrefillPipeline(SPARSE, backend="reference")
    result = pipe(q8, k8, v8, wl.batch, q_descale=qd, k_descale=kd, v_descale=vd)
    assert result.out.dtype == torch.bfloat16
    assert rel_err(result.out, ref) < 0.1
    with pytest.raises(ValueError, match="q_descale"):
        pipe(q8, k8, v8, wl.batch, k_descale=kd, v_descale=vd)


def test_bad_inputs_and_arguments_are_named(planted):
    wl, _ = planted
    pipe = SparsePrefillPipeline(SPARSE, backend="reference")
    with pytest.raises(TypeError, match="q"):
        pipe(wl.q.to(torch.int32), wl.k_cache, wl.v_cache, wl.batch)
    with pytest.raises(ValueError, match="q must hold"):
        pipe(wl.q[:-1], wl.k_cache, wl.v_cache, wl.batch)
    with pytest.raises(ValueError, match="strategy"):
        SparsePrefillPipeline(strategy="top_k_does_not_exist")
    with pytest.raises(TypeError, match="config"):
        SparsePrefillPipeline({"alpha": 0.1})  # type: ignore[arg-type]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 for the Triton backend")
def test_triton_backend_matches_reference_backend_under_the_interpreter():
    # The Triton backend derives the todo bits in the kernel (plan without masks); the reference
    # backend gets materialised masks: both must give the same corrected output.
    w = planted_workload([256], [640], num_q_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float32, seed=5)
    config = SelectionConfig(alpha=0.1, min_sparse_kv_len=0, sink_tokens=128, window_tokens=128)
    ref = SparsePrefillPipeline(config, backend="reference")(w.q, w.k_cache, w.v_cache, w.batch)
    tri = SparsePrefillPipeline(config, backend="triton")(w.q, w.k_cache, w.v_cache, w.batch)
    assert tri.plan.todo_masks is None and ref.plan.todo_masks is not None
    assert torch.equal(tri.index.offsets, ref.index.offsets)
    assert ref.index.density(w.batch) < 1.0
    err = (tri.out.float() - ref.out.float()).norm() / ref.out.float().norm()
    assert float(err) < 2e-3


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 for the Triton backend")
def test_pipeline_runs_in_and_out_of_inference_mode():
    # vLLM runs the forward pass under torch.inference_mode; calls inside and outside it, in turn, reuse the
    # pipeline's cached workspaces and must give the same output.
    w = planted_workload([256], [640], num_q_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.float32, seed=5)
    config = SelectionConfig(alpha=0.1, min_sparse_kv_len=0, sink_tokens=128, window_tokens=128)
    same_output_in_and_out_of_inference_mode(SparsePrefillPipeline(config, backend="triton"), w)


@pytest.mark.parametrize("correction", [True, False])
def test_triton_pooling_writes_the_bf16_copies_only_for_the_correction(monkeypatch, correction):
    # The Triton pooling runs on CUDA inputs; under the interpreter it is made to run on the CPU here.
    pytest.importorskip("triton")
    from fpv2.index.triton import interpreter_enabled
    from fpv2.index.triton.prepared_keys import TritonBlockStatistics

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 to run the Triton pooling on the CPU")
    monkeypatch.setattr("fpv2.serving.pipeline.use_triton_index", lambda q: True)
    wl = planted_workload([300], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32)
    pipe = SparsePrefillPipeline(SPARSE, correction=correction, backend="reference")
    result = pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    stats = result.statistics
    assert isinstance(stats, TritonBlockStatistics)
    if correction:
        k, v = stats.pooled_in(torch.bfloat16)
        assert torch.equal(k.view(torch.int16), stats.pooled_k.to(torch.bfloat16).view(torch.int16))
        assert torch.equal(v.view(torch.int16), stats.pooled_v.to(torch.bfloat16).view(torch.int16))
    else:
        assert stats.pooled_copies is None


def test_inputs_are_validated_once_per_call(monkeypatch, planted):
    # The pipeline checks q, K/V and the descales itself; the index stage does not check them again.
    from fpv2.index import api as index_api
    from fpv2.serving import pipeline as pipeline_module

    calls: list[str] = []

    def counting(where, original):
        def validate(*args, **kwargs):
            calls.append(where)
            return original(*args, **kwargs)

        return validate

    monkeypatch.setattr(
        pipeline_module, "validate_prefill_inputs", counting("pipeline", pipeline_module.validate_prefill_inputs)
    )
    monkeypatch.setattr(index_api, "validate_prefill_inputs", counting("index", index_api.validate_prefill_inputs))
    wl, _ = planted
    for strategy in ("max_threshold", "dense"):
        calls.clear()
        SparsePrefillPipeline(SPARSE, strategy=strategy, backend="reference")(wl.q, wl.k_cache, wl.v_cache, wl.batch)
        assert calls == ["pipeline"], strategy
    # The public entry point still checks its inputs.
    from fpv2.index import build_block_index

    calls.clear()
    build_block_index(wl.q, wl.k_cache, wl.batch, config=SPARSE)
    assert calls == ["index"]
    with pytest.raises(ValueError, match="q must hold"):
        build_block_index(wl.q[:10], wl.k_cache, wl.batch, config=SPARSE)


def test_dense_pipeline_pools_once_on_the_fast_path_and_never_in_the_index(monkeypatch):
    # The dense strategy reads only the statistics' layout: the pipeline pools (K only, on the Triton path) and
    # hands them over, so build_block_index never falls back to the reference pooling (31 ms and host syncs at
    # 128K on the H200 when it did).
    pytest.importorskip("triton")
    from fpv2.index import api as index_api
    from fpv2.index.triton import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 to run the Triton pooling on the CPU")

    def refuse(*args, **kwargs):
        raise AssertionError("build_block_index pooled the keys again")

    monkeypatch.setattr(index_api, "pool_blocks", refuse)
    monkeypatch.setattr("fpv2.serving.pipeline.use_triton_index", lambda q: True)
    wl = planted_workload([300], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32)
    ref = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    result = SparsePrefillPipeline(strategy="dense", correction=False, backend="reference")(
        wl.q, wl.k_cache, wl.v_cache, wl.batch
    )
    assert result.statistics is not None and result.statistics.pooled_v is None  # keys only: no V pass
    assert result.index.density(wl.batch) == pytest.approx(1.0)
    torch.testing.assert_close(result.out, ref, rtol=1e-5, atol=1e-5)
