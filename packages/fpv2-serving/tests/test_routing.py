"""Density routing: table decisions, the batch split/merge round trip, the routed pipeline, table errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from fpv2.index import SelectionConfig
from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.testing import planted_workload
from fpv2.serving.backends import ReferenceBackend, TritonBackend
from fpv2.serving.pipeline import SparsePrefillPipeline
from fpv2.serving.routing import (
    ROUTING_SCHEMA,
    DensityRouter,
    RoutedPrefillPipeline,
    RoutingCurve,
    RoutingKey,
    RoutingPoint,
    RoutingTable,
    default_prefers_sparse,
    kernel_dense_mode,
    merge_outputs,
    split_batch,
)

HQ, HKV, D, PAGE = 4, 2, 64, 16
# Small sinks and windows so that 2K-token requests have blocks to prune.
CONFIG = SelectionConfig(alpha=0.1, sink_tokens=128, window_tokens=128)
KEY = RoutingKey(HQ, HKV, D, "fp32", PAGE, 0.1)
SWITCH = 6144
#: Measured lengths for the small CPU workloads (300..2500 tokens).
SMALL = (256, 512, 1024, 2048, 4096)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many tiny CPU ops: one thread beats a pool on a small shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def power_law_curve(key: RoutingKey, switch: float, lengths=(2048, 4096, 8192, 16384, 32768)) -> RoutingCurve:
    """sparse ~ L, dense ~ L^2 / switch: sparse / dense = switch / L, log-linear in log L, crossing at ``switch``."""
    return RoutingCurve(key, tuple(RoutingPoint(n, float(n) / 1000, n * n / switch / 1000) for n in lengths))


# ------------------------------------------------------------------------ decisions
def test_decisions_on_a_synthetic_table_with_a_crossing_at_6k():
    curve = power_law_curve(KEY, SWITCH)
    assert curve.switch_kv_len() == pytest.approx(SWITCH, rel=1e-9)
    router = DensityRouter(RoutingTable([curve]), config=CONFIG)
    assert not router.prefers_sparse(4096, KEY)
    assert router.prefers_sparse(8192, KEY)
    assert not router.prefers_sparse(6000, KEY) and router.prefers_sparse(6300, KEY)
    # The table overrides min_sparse_kv_len (8192 by default): 7K goes sparse.
    assert CONFIG.min_sparse_kv_len == 8192 and router.prefers_sparse(7000, KEY)
    # The curve is exactly log-linear, so interpolation reproduces it between the points.
    for n in (2500, 5000, 6144, 9000, 20000):
        assert curve.log_ratio(n) == pytest.approx(math.log(SWITCH / n), abs=1e-12)
    # Outside the measured range: the nearest point.
    assert curve.log_ratio(100) == pytest.approx(math.log(SWITCH / 2048))
    assert curve.log_ratio(10**6) == pytest.approx(math.log(SWITCH / 32768))
    assert not router.prefers_sparse(1, KEY) and router.prefers_sparse(10**6, KEY)


def test_interpolation_is_linear_in_log_length_between_two_points():
    # 4K: sparse twice as slow; 8K: sparse twice as fast. Log ratio +-log 2, zero at sqrt(4096 * 8192).
    curve = RoutingCurve(KEY, (RoutingPoint(8192, 1.0, 2.0), RoutingPoint(4096, 2.0, 1.0)))
    assert [p.kv_len for p in curve.points] == [4096, 8192]  # stored ascending
    t = math.log(5000 / 4096) / math.log(2)
    assert curve.log_ratio(5000) == pytest.approx(math.log(2) * (1 - 2 * t), abs=1e-12)
    assert curve.switch_kv_len() == pytest.approx(math.sqrt(4096 * 8192))
    # min_speedup asks for a margin: sparse must be 1.5x faster, reached at 4096 * 2^((1 + log2 1.5) / 2).
    needed = 4096 * 2 ** ((1 + math.log2(1.5)) / 2)
    assert curve.switch_kv_len(min_speedup=1.5) == pytest.approx(needed)
    assert curve.prefers_sparse(8192, min_speedup=1.5) and not curve.prefers_sparse(6000, min_speedup=1.5)


def test_switch_point_is_none_without_a_final_sparse_win_and_ties_go_dense():
    dense_wins = RoutingCurve(KEY, (RoutingPoint(2048, 2.0, 1.0), RoutingPoint(4096, 3.0, 2.0)))
    assert dense_wins.switch_kv_len() is None and not dense_wins.prefers_sparse(10**6)
    sparse_wins = RoutingCurve(KEY, (RoutingPoint(2048, 1.0, 2.0), RoutingPoint(4096, 1.0, 3.0)))
    assert sparse_wins.switch_kv_len() is None and sparse_wins.prefers_sparse(16)
    tie = RoutingCurve(KEY, (RoutingPoint(2048, 1.0, 1.0),))
    assert not tie.prefers_sparse(2048)
    # A non-monotone curve: sparse wins at 4K, loses at 8K, wins again from 16K: the switch is the last crossing.
    bumpy = RoutingCurve(
        KEY, (RoutingPoint(2048, 2.0, 1.0), RoutingPoint(4096, 1.0, 2.0), RoutingPoint(8192, 2.0, 1.0),
              RoutingPoint(16384, 1.0, 2.0))
    )  # fmt: skip
    assert bumpy.switch_kv_len() == pytest.approx(math.sqrt(8192 * 16384))
    assert bumpy.prefers_sparse(4096) and not bumpy.prefers_sparse(8192)


def test_default_rule_without_table_or_curve_never_goes_sparse_below_min_sparse_kv_len():
    for table in (None, RoutingTable([power_law_curve(KEY, 1024)])):
        router = DensityRouter(table, config=CONFIG)
        other = dataclasses.replace(KEY, page_size=1)  # no curve for this key
        for n in (1, 1000, 4096, 8191):
            assert not router.prefers_sparse(n, other) and not default_prefers_sparse(n, CONFIG)
        assert router.prefers_sparse(8192, other) and router.prefers_sparse(50000, other)
        plan = router.plan([10, 0, 10], [100, 9000, 8192], other)
        assert plan.source == "default" and plan.sparse == (False, True, True)
        assert plan.sparse_requests == (2,) and plan.dense_requests == (0,)  # the empty request is in neither
        assert ("no routing table" if table is None else "no measured curve") in plan.reason


def test_floor_and_min_speedup_options():
    table = RoutingTable([power_law_curve(KEY, 1024)])
    assert DensityRouter(table).prefers_sparse(2048, KEY)
    assert not DensityRouter(table, floor_kv_len=4096).prefers_sparse(2048, KEY)
    assert DensityRouter(table, floor_kv_len=4096).prefers_sparse(4096, KEY)
    # sparse / dense = 1024 / L: a 3x speedup needs L > 3072.
    strict = DensityRouter(table, min_speedup=3.0)
    assert not strict.prefers_sparse(3000, KEY) and strict.prefers_sparse(3200, KEY)
    with pytest.raises(ValueError, match="min_speedup"):
        DensityRouter(table, min_speedup=0.5)
    with pytest.raises(TypeError, match="table"):
        DensityRouter({"curves": []})  # type: ignore[arg-type]


# ---------------------------------------------------------------------- table files
def test_table_round_trip_through_a_file(tmp_path):
    curves = [power_law_curve(KEY, SWITCH), power_law_curve(dataclasses.replace(KEY, page_size=1), 3000)]
    path = RoutingTable(curves, meta={"gpu": "test"}).save(tmp_path / "sub" / "table.json")
    data = json.loads(path.read_text())
    assert data["schema"] == ROUTING_SCHEMA and len(data["curves"]) == 2
    assert data["curves"][0]["switch_kv_len"] == pytest.approx(SWITCH)
    loaded = RoutingTable.load(path)
    assert loaded.keys == [c.key for c in curves] and loaded.meta == {"gpu": "test"}
    assert loaded.curve(KEY).points == curves[0].points
    # Keys read from JSON match keys built from a config (alpha rounding).
    assert loaded.curve(RoutingKey(HQ, HKV, D, "fp32", PAGE, 0.1 + 1e-12)) is not None
    router = DensityRouter(path, config=CONFIG)  # a path works too
    assert router.prefers_sparse(8192, KEY) and not router.prefers_sparse(2048, dataclasses.replace(KEY, page_size=1))


def _doc(**curve_changes) -> dict:
    curve = power_law_curve(KEY, SWITCH).to_dict()
    curve.update(curve_changes)
    return {"schema": ROUTING_SCHEMA, "curves": [curve]}


@pytest.mark.parametrize(
    ("doc", "error", "match"),
    [
        ({"curves": []}, ValueError, "schema"),
        ({"schema": "fpv2-routing/0", "curves": []}, ValueError, "schema"),
        ({"schema": ROUTING_SCHEMA, "curves": {}}, TypeError, "'curves' must be a list"),
        ([], TypeError, "JSON object"),
        (_doc(points=[]), ValueError, r"curves\[0\].*no points"),
        (_doc(points="x"), TypeError, r"curves\[0\].points must be a list"),
        (_doc(key={"q_heads": 4}), ValueError, r"curves\[0\].key lacks kv_heads"),
        (_doc(key={**KEY.to_dict(), "dtype": "int8"}), ValueError, "dtype"),
        (_doc(key={**KEY.to_dict(), "q_heads": 3}), ValueError, "multiple of kv_heads"),
        (_doc(key={**KEY.to_dict(), "alpha": 0.0}), ValueError, "alpha"),
        (_doc(points=[{"kv_len": 4096, "sparse_ms": 1.0}]), ValueError, r"points\[0\] lacks 'dense_ms'"),
        (_doc(points=[{"kv_len": "4K", "sparse_ms": 1.0, "dense_ms": 1.0}]), TypeError, r"points\[0\].*kv_len"),
        (_doc(points=[{"kv_len": 4096, "sparse_ms": -1.0, "dense_ms": 1.0}]), ValueError, "sparse_ms"),
        (_doc(points=[{"kv_len": 4096, "sparse_ms": 1.0, "dense_ms": float("nan")}]), ValueError, "dense_ms"),
        (_doc(points=[{"kv_len": 0, "sparse_ms": 1.0, "dense_ms": 1.0}]), ValueError, "kv_len"),
        (
            _doc(points=[{"kv_len": 4096, "sparse_ms": 1.0, "dense_ms": 1.0}] * 2),
            ValueError,
            "measures some kv_len twice",
        ),
        (_doc(meta=[1]), TypeError, "meta"),
    ],
)
def test_malformed_tables_are_refused(doc, error, match):
    with pytest.raises(error, match=match):
        RoutingTable.from_dict(doc)


def test_duplicate_keys_and_bad_files_are_refused(tmp_path):
    doc = _doc()
    doc["curves"] = doc["curves"] * 2
    with pytest.raises(ValueError, match="two curves"):
        RoutingTable.from_dict(doc)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        RoutingTable.load(bad)
    bad.write_text(json.dumps({"schema": ROUTING_SCHEMA, "curves": [{"points": []}]}))
    with pytest.raises(ValueError, match=r"bad.json.*lacks 'key'"):
        DensityRouter(bad)
    with pytest.raises(FileNotFoundError):
        RoutingTable.load(tmp_path / "missing.json")


# ---------------------------------------------------------------------- split/merge
@pytest.fixture(scope="module")
def mixed():
    """Four requests: short, zero-length (prefix only), long, long on a cached prefix; page size 16, fp32."""
    q_lens, kv_lens = [300, 0, 500, 200], [300, 700, 2500, 1800]
    wl = planted_workload(
        q_lens, kv_lens, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE, dtype=torch.float32, seed=2
    )
    return wl


def test_split_batch_picks_metadata_and_rows_and_merge_restores_the_order(mixed):
    q, batch = mixed.q, mixed.batch
    cu = batch.host.cu_seqlens_q
    for parts in ([(0, 2), (3,)], [(0, 3), (1, 2)], [(0, 1, 2, 3)], [(2,), (0,), (3,)]):
        subs = [split_batch(q, batch, p) for p in parts]
        for sub in subs:
            assert sub.batch.num_requests == len(sub.requests)
            assert sub.batch.seqlens_k.tolist() == [batch.host.seqlens_k[b] for b in sub.requests]
            assert sub.batch.host.q_lens == [batch.host.q_lens[b] for b in sub.requests]
            assert torch.equal(sub.batch.page_table, batch.page_table[list(sub.requests)])
            expected_rows = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in sub.requests])
            assert torch.equal(sub.rows, expected_rows)
            assert torch.equal(sub.q, q[expected_rows])
            sub.batch.validate_values()  # the sub-batch is a valid batch over the same cache
        # Merging each sub-batch's own queries must give back the parent's queries, row for row.
        assert torch.equal(merge_outputs([(s, s.q) for s in subs], total_q=q.shape[0]), q)
    assert split_batch(q, batch, [2, 3]).row_range == (cu[2], cu[4])  # contiguous rows: a view
    # Request 1 is empty, so requests 0 and 2 own contiguous rows; 0 and 3 do not.
    assert split_batch(q, batch, [0, 2]).row_range == (0, cu[3])
    assert split_batch(q, batch, [0, 3]).row_range is None


def test_sub_batch_attention_equals_the_parents_rows_exactly(mixed):
    q, k, v, batch = mixed.q, mixed.k_cache, mixed.v_cache, mixed.batch
    whole = dense_attention(q, k, v, batch)
    sub = split_batch(q, batch, [0, 3])
    part = dense_attention(sub.q, k, v, sub.batch)
    assert torch.equal(part, whole[sub.rows])


def test_split_and_merge_errors(mixed):
    q, batch = mixed.q, mixed.batch
    for requests in ([], [2, 1], [0, 0], [4], [-1]):
        with pytest.raises(ValueError, match="strictly ascending"):
            split_batch(q, batch, requests)
    with pytest.raises(TypeError, match="ints"):
        split_batch(q, batch, [0.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="rows"):
        split_batch(q[:-1], batch, [0])
    sub = split_batch(q, batch, [0])
    with pytest.raises(ValueError, match="cover"):
        merge_outputs([(sub, sub.q)], total_q=q.shape[0])


# ------------------------------------------------------------------- routed pipeline
def _rows(out: torch.Tensor, batch: PagedPrefillBatch, b: int) -> torch.Tensor:
    cu = batch.host.cu_seqlens_q
    return out[cu[b] : cu[b + 1]]


def test_routed_equals_one_path_when_both_paths_are_the_reference(mixed):
    q, k, v, batch = mixed.q, mixed.k_cache, mixed.v_cache, mixed.batch
    table = RoutingTable([power_law_curve(KEY, 1000, SMALL)])  # 300 and 700 dense, 1800 and 2500 sparse
    routed = RoutedPrefillPipeline(
        CONFIG, table=table, strategy="dense", correction=False, backend="reference", dense_mode="strategy"
    )
    result = routed(q, k, v, batch)
    assert result.plan.source == "table" and result.plan.sparse == (False, False, True, True)
    assert result.plan.sparse_requests == (2, 3) and result.plan.dense_requests == (0,)
    one_path = SparsePrefillPipeline(CONFIG, strategy="dense", correction=False, backend="reference")
    assert torch.equal(result.out, one_path(q, k, v, batch).out)


def test_routed_rows_equal_each_paths_output_on_the_whole_batch(mixed):
    q, k, v, batch = mixed.q, mixed.k_cache, mixed.v_cache, mixed.batch
    table = RoutingTable([power_law_curve(KEY, 1000, SMALL)])
    routed = RoutedPrefillPipeline(CONFIG, table=table, backend="reference")
    assert routed.dense_path == "strategy"  # the reference backend has no kernel dense mode
    result = routed(q, k, v, batch)
    sparse_config = dataclasses.replace(CONFIG, min_sparse_kv_len=0)
    sparse_whole = SparsePrefillPipeline(sparse_config, backend="reference")(q, k, v, batch)
    dense_whole = dense_attention(q, k, v, batch)
    assert sparse_whole.index.density(batch) < 0.9  # the sparse requests really are sparse
    assert result.sparse is not None and result.sparse_batch.num_requests == 2 and result.dense_batch.num_requests == 1
    for b in (2, 3):
        assert torch.equal(_rows(result.out, batch, b), _rows(sparse_whole.out, batch, b))
    torch.testing.assert_close(_rows(result.out, batch, 0), _rows(dense_whole, batch, 0), rtol=1e-5, atol=1e-5)
    assert result.out.shape == q.shape and torch.isfinite(result.out).all()


def test_routed_without_table_matches_the_unrouted_pipeline(mixed):
    q, k, v, batch = mixed.q, mixed.k_cache, mixed.v_cache, mixed.batch
    config = dataclasses.replace(CONFIG, min_sparse_kv_len=1000)
    result = RoutedPrefillPipeline(config, backend="reference")(q, k, v, batch)
    assert result.plan.source == "default" and result.plan.sparse == (False, False, True, True)
    unrouted = SparsePrefillPipeline(config, backend="reference")(q, k, v, batch)
    torch.testing.assert_close(result.out, unrouted.out, rtol=1e-6, atol=1e-6)


def test_unsplit_batches_and_empty_batches(mixed):
    q, k, v, batch = mixed.q, mixed.k_cache, mixed.v_cache, mixed.batch
    everything_dense = RoutedPrefillPipeline(CONFIG, backend="reference")(q, k, v, batch)  # default: all < 8192
    assert everything_dense.sparse is None and everything_dense.dense_batch is batch
    torch.testing.assert_close(everything_dense.out, dense_attention(q, k, v, batch), rtol=1e-5, atol=1e-5)
    table = RoutingTable([power_law_curve(KEY, 16)])
    everything_sparse = RoutedPrefillPipeline(CONFIG, table=table, backend="reference")(q, k, v, batch)
    assert everything_sparse.dense_batch is None and everything_sparse.sparse_batch is batch
    empty = PagedPrefillBatch.contiguous([0, 0], [5, 9], page_size=PAGE)
    k_e = torch.randn(empty.num_pages, PAGE, HKV, D)
    result = RoutedPrefillPipeline(CONFIG, backend="reference")(torch.empty(0, HQ, D), k_e, k_e, empty)
    assert result.out.shape == (0, HQ, D) and result.sparse is None and result.dense_batch is None


def test_dense_mode_options():
    assert kernel_dense_mode(ReferenceBackend()) is None
    assert kernel_dense_mode(TritonBackend()) is not None

    class WithDense(ReferenceBackend):
        name = "with-dense"

        def run_dense(self, q, k_cache, v_cache, batch, **kw):
            return dense_attention(q, k_cache, v_cache, batch).to(q.dtype)

    backend = WithDense()
    assert kernel_dense_mode(backend) == backend.run_dense
    assert RoutedPrefillPipeline(backend=backend).dense_path == "kernel"
    assert RoutedPrefillPipeline(backend=backend, dense_mode="strategy").dense_path == "strategy"
    with pytest.raises(ValueError, match="no kernel dense mode"):
        RoutedPrefillPipeline(backend="reference", dense_mode="kernel")
    with pytest.raises(ValueError, match="dense_mode"):
        RoutedPrefillPipeline(backend="reference", dense_mode="fast")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 for the Triton backend")
def test_triton_kernel_dense_mode_under_the_interpreter():
    wl = planted_workload(
        [100, 150], [100, 300], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, dtype=torch.float32, seed=4
    )
    routed = RoutedPrefillPipeline(CONFIG, backend="triton")
    assert routed.dense_path == "kernel"
    out = routed(wl.q, wl.k_cache, wl.v_cache, wl.batch).out
    torch.testing.assert_close(out, dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch), rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ the script (CPU)
def _load_script():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "routing_switch_point.py"
    if not path.exists():
        pytest.skip("benchmarks/routing_switch_point.py is not in this checkout")
    spec = importlib.util.spec_from_file_location("routing_switch_point", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_switch_point_script_dry_run_writes_a_loadable_table(tmp_path, capsys):
    script = _load_script()
    args = ["--device", "cpu", "--seqlens", "128", "256", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64"]
    args += ["--dtype", "fp32", "--backend", "reference", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]
    args += ["--sink-tokens", "0", "--window-tokens", "0", "--page-sizes", "1", "16"]
    assert script.main(args) == 0
    table = RoutingTable.load(tmp_path / "routing-table.json")
    assert len(table) == 2
    curve = table.curve(RoutingKey(4, 2, 64, "fp32", 16, 0.1))
    assert [p.kv_len for p in curve.points] == [128, 256] and curve.meta["backend"] == "reference"
    assert all(p.sparse_ms > 0 and p.dense_ms > 0 and 0 < p.density <= 1 for p in curve.points)
    assert (next(tmp_path.glob("*.png"))).read_bytes()[:4] == b"\x89PNG"
    assert "switch point" in capsys.readouterr().out
    # The CPU is synchronous: no host-ahead time, so the curve compares the eager pair and says so.
    assert curve.meta["timing"] == "eager"
    rows = json.loads(next(tmp_path.glob("routing-switch-point-*.json")).read_text())["rows"]
    assert all(r["timing"] == "eager" and r["host_ahead_sparse_ms"] is None for r in rows)
    assert all(r["sparse_ms"] == r["eager_sparse_ms"] and r["dense_ms"] == r["eager_dense_ms"] for r in rows)


def test_switch_point_script_names_a_curve_by_the_timing_its_points_share():
    script = _load_script()
    assert script._curve_timing(["host-ahead", "host-ahead"]) == "host-ahead"
    assert script._curve_timing(["eager"]) == "eager"
    assert script._curve_timing(["host-ahead", "eager"]) == "mixed"
    assert script.parse_args(["--out", "x"]).timing == "host-ahead"
    assert script.parse_args(["--out", "x", "--timing", "eager"]).timing == "eager"


# ------------------------------------------------------------------- shipped measurement
def test_shipped_h200_table_is_used_on_that_gpu_only(monkeypatch):
    from fpv2.serving import routing_measured
    from fpv2.serving.routing import MEASURED, DensityRouter, RoutingKey, RoutingTable

    table = RoutingTable.from_dict(routing_measured.H200_TABLE)
    key = RoutingKey(32, 8, 128, "bf16", 1, 0.1)
    curve = table.curve(key)
    # Page size 1 on the Hopper kernel after the tile repack (2026-12-04; 8,934 on its cp.async gather the day
    # before, 10,069 on the Triton backends before that).
    assert curve is not None and 9_000 < curve.switch_kv_len() < 9_160  # measured: 9,078
    assert not curve.prefers_sparse(8192) and curve.prefers_sparse(16384)
    # Page size 16 through the same copy: sparse from about 9,918 KV tokens on.
    page16 = table.curve(RoutingKey(32, 8, 128, "bf16", 16, 0.1))
    assert page16 is not None and 9_800 < page16.switch_kv_len() < 10_050
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    router = DensityRouter()  # the default table is MEASURED
    assert router.curve_for(key) is not None and router.curve_for(RoutingKey(32, 8, 128, "bf16", 64, 0.1)) is None
    # The Hopper kernel's page-128 curve (measured 2026-12-01): sparse from about 9,219 KV tokens on.
    hopper = table.curve(RoutingKey(32, 8, 128, "bf16", 128, 0.1))
    assert hopper is not None and 9_100 < hopper.switch_kv_len() < 9_350
    assert router.prefers_sparse(8192, RoutingKey(32, 8, 128, "bf16", 128, 0.1)) is False
    assert router.prefers_sparse(8192, key) is False  # the default rule would say sparse here
    assert router.prefers_sparse(8192, RoutingKey(32, 8, 128, "bf16", 16, 0.1)) is False
    assert router.prefers_sparse(8192, RoutingKey(32, 8, 128, "bf16", 64, 0.1)) is True  # unmeasured key: the rule
    assert router.prefers_sparse(12288, key) is True
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert routing_measured.measured_table() is None and DensityRouter(MEASURED).table is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert routing_measured.measured_table() is None


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_routed_pipeline_on_cuda_matches_both_paths():
    wl = planted_workload(
        [1024, 0, 8192, 2048], [1024, 512, 8192, 6144], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
        dtype=torch.bfloat16, device="cuda", seed=3,
    )  # fmt: skip
    key = RoutingKey(32, 8, 128, "bf16", 16, 0.1)
    routed = RoutedPrefillPipeline(table=RoutingTable([power_law_curve(key, 4096)]))
    assert routed.dense_path == "kernel"  # the Triton kernel's dense mode
    result = routed(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert result.plan.sparse_requests == (2, 3) and result.plan.dense_requests == (0,)
    ref = dense_attention(wl.q.float(), wl.k_cache.float(), wl.v_cache.float(), wl.batch)
    rows = _rows(result.out, wl.batch, 0).float()
    assert float((rows - _rows(ref, wl.batch, 0)).norm() / _rows(ref, wl.batch, 0).norm()) < 1e-2
    sparse_whole = routed.sparse_pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch).out
    for b in (2, 3):
        torch.testing.assert_close(_rows(result.out, wl.batch, b), _rows(sparse_whole, wl.batch, b), rtol=0, atol=0)
    err = float((result.out.float() - ref).norm() / ref.norm())
    print(f"routed vs fp32 dense: rel err {err:.4f}")
    assert err < 0.1
