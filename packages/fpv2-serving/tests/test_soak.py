"""Soak harness: schedule, probes, a CPU soak with RSS bounded, leak detection, and the GPU soak."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from fpv2.index import SelectionConfig
from fpv2.index.triton.workspace import IndexWorkspace
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.reference.pooling import pool_blocks
from fpv2.kernel.testing import planted_workload
from fpv2.serving.soak import (
    MAX_SYNCS_PER_CALL,
    SYNC_WARNING,
    CallRecord,
    SoakCall,
    SoakConfig,
    SoakError,
    SyncCounter,
    WorkspaceProbe,
    draw_compositions,
    run_soak,
    summarise,
    workspace_bound,
    workspace_formula,
    write_soak_plot,
)

MIB = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The CPU soaks run many tiny ops: one thread is 10x faster than a pool on a small shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------- schedule
def test_schedule_is_seeded_varied_and_valid():
    cfg = SoakConfig.for_cpu(calls=400, seed=7)
    comps = list(draw_compositions(cfg))
    assert comps == list(draw_compositions(cfg)) and comps != list(draw_compositions(dataclasses.replace(cfg, seed=8)))
    assert len(comps) == 400
    # Worst case first, one per page size.
    for comp, page in zip(comps, cfg.page_sizes):
        assert comp.page_size == page and comp.q_lens == comp.kv_lens == (cfg.max_len,) * cfg.max_batch
    for c in comps:
        assert 1 <= len(c.q_lens) <= cfg.max_batch and c.page_size in cfg.page_sizes
        assert all(0 <= q <= k <= cfg.max_len and k >= 1 for q, k in zip(c.q_lens, c.kv_lens))
        assert any(c.q_lens)  # never a batch without queries
    assert {c.page_size for c in comps} == set(cfg.page_sizes)
    assert sum(c.prefixes for c in comps) > 50 and sum(c.empties for c in comps) > 5
    assert {len(c.q_lens) for c in comps} == set(range(1, cfg.max_batch + 1))


def test_config_validation():
    with pytest.raises(ValueError, match="calls"):
        SoakConfig(calls=0)
    with pytest.raises(TypeError, match="max_len"):
        SoakConfig(max_len=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        SoakConfig(q_heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="page_sizes"):
        SoakConfig(page_sizes=())
    with pytest.raises(ValueError, match="<= 1"):
        SoakConfig(prefix_probability=0.7, empty_probability=0.5)
    with pytest.raises(ValueError, match="alpha"):
        SoakConfig(alpha=0.0)
    assert SoakConfig(calls=10_000).steady_start == 1000 and SoakConfig(calls=50).steady_start == 5


# --------------------------------------------------------------------------- probes
def test_workspace_formula_by_hand_and_probe_records_reserves():
    # Hkv=8, g=4, tiles of 128 packed rows: 4096 queries -> 128 tiles, 100 -> 4 tiles; S = 8 * 132 = 1056.
    # Nb = 4096 / 128 = 32 blocks; CPU (interpreter) cap of 8 programs; W = 2 words per segment.
    config = SelectionConfig()
    nbytes, shape = workspace_formula(
        [4096, 100], [4096, 3000], kv_heads=8, group=4, config=config, device=torch.device("cpu")
    )
    assert shape == (8, 32, 1056)
    assert nbytes == 4 * (8 * 32 + 1056 * 2 + 1056) == 13696
    # The Hopper scoring kernel reserves one energies row (fpv2.index.triton.api: num_programs=1).
    hopper_bytes, hopper_shape = workspace_formula(
        [4096, 100], [4096, 3000], kv_heads=8, group=4, config=config, device=torch.device("cpu"),
        scoring_on_hopper=True,
    )  # fmt: skip
    assert hopper_shape == (1, 32, 1056) and hopper_bytes == 4 * (1 * 32 + 1056 * 2 + 1056)
    bound, bound_shape = workspace_bound(SoakConfig.for_cpu(), torch.device("cpu"))
    # for_cpu: 4 requests of 640 tokens, Hkv=2, g=2: tiles = 10 each, S = 2 * 40 = 80; Nb = 5.
    assert bound_shape == (8, 5, 80) and bound == 4 * (8 * 5 + 80 * 2 + 80)
    with WorkspaceProbe() as probe:
        ws = IndexWorkspace()
        ws.reserve(num_programs=8, max_blocks=32, num_segments=1056, device=torch.device("cpu"))
        assert probe.take() == (13696, (8, 32, 1056))
        assert probe.take() == (None, None)
        ws.reserve(num_programs=8, max_blocks=5, num_segments=80, device=torch.device("cpu"))
        assert probe.take()[0] == 13696  # the buffers never shrink: nbytes is the capacity held
    assert IndexWorkspace.reserve.__name__ == "reserve" and "probe" not in IndexWorkspace.reserve.__qualname__


def test_workspace_verdict_allows_reused_capacity_but_not_a_wrong_shape():
    cfg = SoakConfig.for_cpu(calls=3, steady_fraction=1.0)
    bound, bound_shape = workspace_bound(cfg, torch.device("cpu"))
    small, small_shape = workspace_formula(
        [100], [100], kv_heads=cfg.kv_heads, group=2, config=cfg.selection(), device=torch.device("cpu")
    )

    def record(i: int, held: int, shape: tuple[int, int, int]) -> CallRecord:
        return CallRecord(
            i, 1, 1, 100, 100, 0, 0, 1.0, rss=1 << 20, workspace_bytes=held, workspace_expected=small,
            workspace_shape=shape, expected_shape=small_shape,
        )  # fmt: skip

    # The worst case first, then small calls on the same (reused) workspace: held > needed is fine.
    reused = [record(0, bound, small_shape), record(1, bound, small_shape), record(2, small, small_shape)]
    workspace = summarise(reused, cfg, torch.device("cpu"))["workspace"]
    assert workspace["formula_mismatches"] == 0 and workspace["within_bound"]
    assert workspace["held_equals_call_formula"] == 1
    wrong_shape = (small_shape[0], small_shape[1] + 1, small_shape[2])
    for bad in (record(1, bound, wrong_shape), record(1, small - 4, small_shape), record(1, bound + 4, small_shape)):
        workspace = summarise([reused[0], bad, reused[2]], cfg, torch.device("cpu"))["workspace"]
        assert workspace["formula_mismatches"] == 1 or not workspace["within_bound"]
    assert bound_shape[2] > small_shape[2]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 for the Triton index")
def test_probe_sees_what_the_triton_index_reserves_and_the_formula_predicts_it():
    from fpv2.index.triton import select_blocks_triton  # imports triton

    # Varlen, an empty request with a long prefix (it sets Nb), page size 16.
    wl = planted_workload(
        [300, 0, 200], [300, 1100, 900], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32
    )
    config = SelectionConfig()
    stats = pool_blocks(wl.k_cache, None, wl.batch, block_size=config.block_size)
    with WorkspaceProbe() as probe:
        select_blocks_triton(wl.q, wl.batch, stats, config=config)
    measured = probe.take()
    # By hand: g=2, tiles ceil(600/128)=5, 0, ceil(400/128)=4 -> S = 2 * 9 = 18; Nb = ceil(1100/128) = 9; P = 8.
    assert measured == (4 * (8 * 9 + 18 * 2 + 18), (8, 9, 18))
    formula = workspace_formula(
        wl.batch.host.q_lens, wl.batch.host.seqlens_k, kv_heads=2, group=2, config=config, device=torch.device("cpu")
    )
    assert formula == measured


_FAKE_FPV2 = """
import warnings
def emit(n):
    for _ in range(n):
        warnings.warn("called a synchronizing CUDA operation")
"""


def test_sync_counter_counts_and_attributes_sync_warnings():
    namespace: dict = {}
    exec(compile(_FAKE_FPV2, "/somewhere/fpv2/fake/module.py", "exec"), namespace)
    with SyncCounter(active=True) as counter:
        namespace["emit"](3)
        count, sites = counter.take()
        assert count == 3 and sites == {"fpv2/fake/module.py:5 emit": 3}
        with pytest.warns(UserWarning, match="unrelated"):
            warnings.warn("unrelated warning", stacklevel=1)  # other warnings pass through, uncounted
        warnings.warn(SYNC_WARNING, stacklevel=1)  # from a frame outside fpv2: attributed to its file and line
        count, sites = counter.take()
        assert count == 1 and next(iter(sites)).startswith(__file__)
        counter.reset()
        assert counter.take()[0] == 0
    assert SyncCounter(active=False).take()[0] is None


# ------------------------------------------------------------------------ CPU soak
def test_cpu_soak_of_50_calls_keeps_rss_flat_across_page_sizes_prefixes_and_empty_requests(tmp_path):
    cfg = SoakConfig.for_cpu(rss_growth_bound=8 * MIB)
    checked = []

    def dense_rows_are_right(call: SoakCall) -> None:
        # The harness builds real batches: spot-check a request against dense attention on its own.
        if call.index % 10 == 3:
            ref = dense_attention(call.q, call.k_cache, call.v_cache, call.batch)
            assert call.result.out.shape == ref.shape and torch.isfinite(call.result.out).all()
            checked.append(call.index)

    result = run_soak(cfg, device="cpu", on_call=dense_rows_are_right)
    assert result.error is None and len(result.records) == 50 and checked == [3, 13, 23, 33, 43]
    summary = result.summary
    comps = summary["compositions"]
    assert set(comps["page_sizes"]) == {1, 16, 64}
    assert comps["requests_with_prefix"] > 0 and comps["zero_length_requests"] > 0
    rss = summary["memory"]["rss"]
    assert rss["flat"] and rss["growth_bytes"] <= 8 * MIB, rss
    assert summary["workspace"]["measured_calls"] == 0  # the reference index on the CPU has no workspace
    assert summary["syncs"]["method"].startswith("not counted") and summary["ok"]
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["schema"] == "fpv2-soak/1" and len(doc["calls"]["rss"]) == 50
    assert write_soak_plot(tmp_path / "soak.png", result).read_bytes()[:4] == b"\x89PNG"


def test_cpu_soak_through_the_dense_strategy_matches_dense_attention():
    # With every block kept and no correction the pipeline is dense attention: every call must match it,
    # which checks that the soak's batches (shuffled pages, prefixes, empty requests) are consistent.
    cfg = SoakConfig.for_cpu(calls=12, strategy="dense", correction=False)

    def matches(call: SoakCall) -> None:
        ref = dense_attention(call.q, call.k_cache, call.v_cache, call.batch)
        torch.testing.assert_close(call.result.out, ref, rtol=1e-5, atol=1e-5)

    assert run_soak(cfg, device="cpu", on_call=matches).error is None


def test_soak_starts_from_fresh_index_workspaces():
    # The strategy's cached workspaces keep the capacity of the largest call this process made (a 32K test
    # earlier in the same pytest run once made the GPU soak's bytes exceed its 4K formula): the soak drops them.
    from fpv2.index import get_strategy

    strategy = get_strategy("max_threshold")
    big = IndexWorkspace("cpu")
    big.reserve(num_programs=8, max_blocks=256, num_segments=64, device=torch.device("cpu"))
    strategy._workspaces[(torch.device("cpu"), 0)] = big
    assert run_soak(SoakConfig.for_cpu(calls=2), device="cpu").error is None
    assert big not in strategy._workspaces.values()
    assert strategy.release_workspaces() == len(strategy._workspaces) == 0


def test_a_leak_makes_the_cpu_soak_fail():
    cfg = SoakConfig.for_cpu(calls=40, rss_growth_bound=8 * MIB)
    kept = []

    def leak(call: SoakCall) -> None:
        # 4 MiB per call (160 MiB in all), touched, never freed during the run: well above the bound even
        # when the allocator first reuses pages freed by earlier tests in the same process (2 MiB a call
        # grew RSS by only 11 MB in one CI run, after the suite's earlier tests had freed their memory).
        kept.append(torch.ones(MIB))

    summary = run_soak(cfg, device="cpu", on_call=leak).summary
    assert not summary["memory"]["rss"]["flat"] and not summary["ok"]
    assert summary["memory"]["rss"]["growth_bytes"] > 16 * MIB


def test_a_failing_call_raises_with_the_partial_result():
    cfg = SoakConfig.for_cpu(calls=10)
    from fpv2.serving.pipeline import SparsePrefillPipeline

    plain = SparsePrefillPipeline(cfg.selection(), backend="reference")
    calls = []

    def flaky(q, k_cache, v_cache, batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return plain(q, k_cache, v_cache, batch)

    with pytest.raises(SoakError, match=r"call 3 .*boom") as info:
        run_soak(cfg, device="cpu", pipeline=flaky)
    assert len(info.value.result.records) == 3 and "boom" in info.value.result.error


def test_time_limit_stops_the_soak_and_says_so():
    cfg = SoakConfig.for_cpu(calls=10_000, time_limit_s=0.3)
    from fpv2.serving.pipeline import SparsePrefillPipeline

    plain = SparsePrefillPipeline(cfg.selection(), backend="reference")
    result = run_soak(cfg, device="cpu", pipeline=lambda *args: plain(*args))
    assert result.stopped_early and 0 < len(result.records) < cfg.calls
    assert result.summary["stopped_at_time_limit"] and result.summary["calls"] == len(result.records)
    assert result.summary["calls_planned"] == 10_000 and result.summary["wall_s"] >= 0.3
    assert result.to_dict()["stopped_early"]
    with pytest.raises(ValueError, match="time_limit_s"):
        SoakConfig(time_limit_s=0.0)
    with pytest.raises(TypeError, match="time_limit_s"):
        SoakConfig(time_limit_s="10")


def test_routed_cpu_soak_runs(tmp_path):
    cfg = SoakConfig.for_cpu(calls=12, routed=True, min_sparse_kv_len=300)
    result = run_soak(cfg, device="cpu")
    assert result.error is None and result.summary["memory"]["rss"]["flat"]


# ------------------------------------------------------------------ the script (CPU)
def test_soak_script_dry_run(tmp_path, capsys):
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "soak.py"
    if not path.exists():
        pytest.skip("benchmarks/soak.py is not in this checkout")
    spec = importlib.util.spec_from_file_location("soak_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--device", "cpu", "--calls", "8", "--out", str(tmp_path), "--no-progress"]) == 0
    doc = json.loads(next(tmp_path.glob("soak-*.json")).read_text())
    assert doc["summary"]["calls"] == 8 and doc["backend"] == "reference"
    assert "verdict: ok" in capsys.readouterr().out


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_soak_of_300_calls_flat_memory_bounded_workspace_no_syncs(monkeypatch):
    """300 calls on the Triton backend (the default on CUDA without the native library).

    The fast path (Triton index, Triton attention, correction, host view seeded) makes no
    host synchronisation in steady state: MAX_SYNCS_PER_CALL is 0
    (fpv2.serving.soak.EXPECTED_FAST_PATH_SYNCS is empty).

    The index's scoring is pinned to the fused Triton pass (the scenario of a GPU without the native
    library); with the default (``auto``) an sm_90 GPU scores on the Hopper kernel, which reserves one
    energies row (the formula's ``scoring_on_hopper``).
    """
    monkeypatch.setenv("FPV2_INDEX_SCORING", "triton")
    assert MAX_SYNCS_PER_CALL == 0
    cfg = SoakConfig(calls=300, max_batch=4, max_len=4096, min_sparse_kv_len=1024, check_every=25, backend="triton")
    result = run_soak(cfg, device="cuda")
    summary = result.summary
    print(json.dumps({k: summary[k] for k in ("memory", "workspace", "syncs")}, indent=1, default=str))
    assert result.error is None
    memory = summary["memory"]
    assert memory["cuda_allocated"]["flat"], memory["cuda_allocated"]
    assert memory["cuda_reserved"]["flat"], memory["cuda_reserved"]
    workspace = summary["workspace"]
    assert workspace["measured_calls"] == 300  # the Triton index ran every call
    assert workspace["formula_mismatches"] == 0, workspace["first_mismatch"]
    assert workspace["within_bound"] and workspace["max_bytes"] <= workspace["bound_bytes"]
    syncs = summary["syncs"]
    print(f"host syncs per steady call: {syncs['per_call_histogram']}; sites: {syncs['sites_per_call']}")
    assert syncs["per_call_max"] == 0 and syncs["zero_on_fast_path"], syncs["sites_per_call"]
    assert summary["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_routed_soak_makes_no_host_sync():
    """The routed pipeline (split, dense kernel mode, sparse pipeline, merge) adds no host sync either."""
    cfg = SoakConfig(
        calls=120, max_batch=4, max_len=4096, min_sparse_kv_len=2048, backend="triton", routed=True, check_every=30
    )
    result = run_soak(cfg, device="cuda")
    assert result.error is None
    syncs = result.summary["syncs"]
    assert syncs["per_call_max"] == 0, syncs["sites_per_call"]
