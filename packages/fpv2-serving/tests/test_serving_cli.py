"""The ``fpv2`` command line: ``info``, ``bench`` on a tiny CPU input, and argument errors."""

from __future__ import annotations

import json

import pytest
import torch

from fpv2.serving import backends as registry
from fpv2.serving import cli
from fpv2.serving.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["-B", "1", "-L", "1024", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--dtype", "fp32"]
TINY_RUN = [*TINY, "--device", "cpu", "--repeats", "2", "--warmup", "0", "--min-sparse-kv-len", "0", "--no-progress"]
# The protocol's keys and JSON types, written out here independently of fpv2.serving.report.
REQUIRED = {
    "impl": str,
    "dtype": str,
    "B": int,
    "L": int,
    "Hq": int,
    "Hkv": int,
    "d": int,
    "page_size": int,
    "workload": str,
    "ms": float,
    "index_ms": (float, type(None)),
    "correction": bool,
    "density": (float, type(None)),
    "rel_err": (float, type(None)),
    "tflops": float,
    "commit": str,
    "gpu": str,
}


def test_info_names_every_component(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("fpv2-kernel", "fpv2-index", "fpv2-correction", "fpv2-serving", "native library", "torch", "triton"):
        assert word in out, word
    assert torch.__version__ in out
    assert ("no GPU" in out) != torch.cuda.is_available()
    assert "reference: available" in out
    assert "hopper:" in out
    assert "max_threshold" in out and "dense" in out


def test_info_says_which_scoring_pass_the_index_takes(monkeypatch, capsys):
    pytest.importorskip("triton")
    from fpv2.index.triton import hopper_scoring
    from fpv2.serving import environment

    monkeypatch.delenv(hopper_scoring.SCORING_ENV, raising=False)
    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("index scoring:"))
    assert "auto (FPV2_INDEX_SCORING)" in line
    if not torch.cuda.is_available():
        assert "the fused Triton pass here (no CUDA device is visible to torch)" in line
    # A device the kernel serves, and each mode's wording.
    monkeypatch.setattr(hopper_scoring, "device_scoring_reason", lambda device_index=None: None)
    assert "the Hopper wgmma kernel" in environment.index_scoring()
    assert "Triton pass for the rest" in environment.index_scoring()
    monkeypatch.setenv(hopper_scoring.SCORING_ENV, "triton")
    assert environment.index_scoring() == "triton (FPV2_INDEX_SCORING): the fused Triton pass"
    monkeypatch.setattr(hopper_scoring, "device_scoring_reason", lambda device_index=None: "an sm_80 GPU")
    monkeypatch.setenv(hopper_scoring.SCORING_ENV, "hopper")
    assert environment.index_scoring() == "hopper (FPV2_INDEX_SCORING): calls will be refused here (an sm_80 GPU)"
    monkeypatch.setenv(hopper_scoring.SCORING_ENV, "sometimes")
    assert environment.index_scoring().startswith("unavailable (ValueError: FPV2_INDEX_SCORING='sometimes'")
    assert "index_scoring" in environment.environment_record()


def test_bench_tiny_cpu_writes_results_summary_and_png(tmp_path, capsys):
    code = main(["bench", *TINY_RUN, "--alpha", "0.1", "--alpha", "0.3", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "fpv2-sparse/reference" in captured.out  # the table

    results = sorted(tmp_path.glob("bench-*.json"))
    assert len(results) == 1
    payload = json.loads(results[0].read_text())
    assert payload["config"]["seqlen"] == 1024 and payload["config"]["alphas"] == [0.1, 0.3]
    assert set(payload["wheels"]) == {"fpv2-kernel", "fpv2-index", "fpv2-correction", "fpv2-serving"}
    assert payload["torch"] == torch.__version__ and "commit" in payload and "machine" in payload
    # The device's name, in the file and the table title (a row's timing fields once overwrote it).
    assert payload["gpu"] == "cpu" and " on cpu (" in captured.out
    assert any("CPU run" in note for note in payload["notes"])

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert isinstance(summary, list) and len(summary) == len(payload["rows"]) == 5
    for record in summary:
        for key, types in REQUIRED.items():
            assert key in record, key
            assert isinstance(record[key], types), (key, record[key])
            if types is int:
                assert not isinstance(record[key], bool), key
        assert (record["B"], record["L"], record["Hq"], record["Hkv"], record["d"]) == (1, 1024, 4, 2, 64)
        assert record["dtype"] == "fp32" and record["workload"] == "planted" and record["gpu"] == "cpu"
        assert record["ms"] > 0
        assert "gpu_ms" not in record  # host-ahead timing exists on CUDA only: no made-up GPU column
    impls = [r["impl"] for r in summary]
    assert impls.count("fpv2-dense/reference") == 1
    assert impls.count("fpv2-sparse/reference") == 2 and impls.count("fpv2-index") == 2
    dense = next(r for r in summary if r["impl"] == "fpv2-dense/reference")
    assert dense["density"] == pytest.approx(1.0) and dense["rel_err"] < 1e-5
    # The reference reads the paged cache as it is and records no layout: the field says so, it is not guessed.
    assert all(r["kv_layout"] is None for r in summary if r["impl"] != "fpv2-index")
    sparse = [r for r in summary if r["impl"] == "fpv2-sparse/reference"]
    assert [r["alpha"] for r in sparse] == [0.1, 0.3]
    for r in sparse:
        assert 0.0 < r["density"] <= 1.0 and r["correction"] is True and r["index_ms"] > 0
        assert r["rel_err"] < 0.2
    # A larger alpha keeps no more blocks.
    assert sparse[1]["density"] <= sparse[0]["density"]

    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 1
    assert pngs[0].read_bytes()[:8] == PNG_MAGIC


def test_bench_warmup_ms_is_gpu_only_and_recorded(tmp_path, capsys, monkeypatch):
    from fpv2.serving import bench

    def no_timed_warm_up(*args, **kwargs):
        raise AssertionError("the time-based warm-up runs on CUDA only")

    monkeypatch.setattr(bench, "warm_for", no_timed_warm_up)
    code = main(["bench", *TINY_RUN, "--warmup-ms", "1000", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    payload = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    assert payload["config"]["warmup_ms"] == 1000.0
    assert payload["rows"] and all(row["warmup_ms"] == 0.0 for row in payload["rows"])  # none ran on the CPU


def test_bench_on_vllm_views_gives_the_paged_runs_results(tmp_path, capsys):
    # --cache-layout vllm hands the pipeline vLLM's strided K/V views of one buffer: same values, other strides.
    rows = {}
    for layout in ("paged", "vllm"):
        out = tmp_path / layout
        code = main(["bench", *TINY_RUN, "--page-size", "16", "--cache-layout", layout, "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        results = list(out.glob("bench-*.json"))
        assert len(results) == 1 and (layout == "vllm") == ("-p16-vllm-" in results[0].name)
        payload = json.loads(results[0].read_text())
        assert payload["config"]["cache_layout"] == layout
        rows[layout] = [r for r in payload["rows"] if r["impl"].startswith("fpv2-sparse")]
        assert rows[layout] and all(r["cache_layout"] == layout for r in rows[layout])
    paged, vllm = rows["paged"][0], rows["vllm"][0]
    assert vllm["density"] == paged["density"] and vllm["rel_err"] == pytest.approx(paged["rel_err"], rel=1e-6)


def test_bench_needle_and_ablation(tmp_path, capsys):
    code = main(["bench", *TINY_RUN, "--needle", "--ablation", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(next(tmp_path.glob("bench-*.json")).read_text())["rows"]
    sparse = [r for r in rows if r["impl"] == "fpv2-sparse/reference"]
    assert [r["correction"] for r in sparse] == [True, False]
    assert all(r["workload"] == "needle" and isinstance(r["needle_rel_err"], float) for r in sparse)
    # Same selection, so the correction is the only difference between the two outputs.
    assert sparse[0]["density"] == sparse[1]["density"] and sparse[0]["rel_err"] != sparse[1]["rel_err"]


def test_bench_on_the_drifting_background(tmp_path, capsys):
    # Same shapes and seed, other background: the records name it and the inputs differ from the planted run's.
    rows = {}
    for name, extra in (("planted", []), ("drifting", ["--drift-tokens", "64"])):
        out = tmp_path / name
        code = main(["bench", *TINY_RUN, *extra, "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        results = list(out.glob("bench-*.json"))
        assert len(results) == 1 and results[0].name.endswith(f"-{name}.json")
        payload = json.loads(results[0].read_text())
        assert payload["config"]["drift_tokens"] == (64.0 if extra else None)
        rows[name] = [r for r in payload["rows"] if r["impl"].startswith("fpv2-sparse")]
        assert rows[name] and all(r["workload"] == name for r in rows[name])
    assert rows["drifting"][0]["rel_err"] != rows["planted"][0]["rel_err"]


def test_bench_runs_each_corrected_run_per_mass_shift(tmp_path, capsys):
    code = main(["bench", *TINY_RUN, "--drift-tokens", "64", "--ablation", "--mass-shift", "mean",
                 "--mass-shift", "second_order", "--repeats", "1", "--out", str(tmp_path)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    payload = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    sparse = [r for r in payload["rows"] if r["impl"] == "fpv2-sparse/reference"]
    assert [(r["correction"], r["mass_shift"]) for r in sparse] == [(True, "mean"), (True, "second_order"),
                                                                     (False, None)]  # fmt: skip
    assert len({r["density"] for r in sparse}) == 1  # one selection: the shift changes the correction only
    mean, second, off = (r["rel_err"] for r in sparse)
    assert second < mean < off  # the drifting background: the shift states the pruned mass better
    assert payload["config"]["mass_shifts"] == ["mean", "second_order"]
    summary = json.loads(next(tmp_path.glob("summary*.json")).read_text())
    assert {r.get("mass_shift") for r in summary if r["impl"] == "fpv2-sparse/reference"} == {"mean", "second_order",
                                                                                                None}  # fmt: skip
    assert " 2nd " in captured.out  # the table's correction column


def test_mass_shift_reaches_the_config():
    parser, _ = cli._build_parser()
    config, _ = cli._bench_config(parser.parse_args(["bench", "--device", "cpu"]))
    assert config.mass_shifts == ("mean",)
    args = ["bench", "--device", "cpu", "--mass-shift", "second_order", "--mass-shift", "second_order"]
    config, _ = cli._bench_config(parser.parse_args(args))
    assert config.mass_shifts == ("second_order",)
    config, _ = cli._bench_config(
        parser.parse_args(["bench", "--device", "cpu", *"--alpha 0.1 --alpha 0.4 --alpha 0.1".split()])
    )
    assert config.alphas == (0.1, 0.4)  # the device scripts' default alpha plus the same one again: one run


def test_workload_names():
    parser, _ = cli._build_parser()
    names = {}
    for extra in ([], ["--needle"], ["--drift-tokens", "256"], ["--needle", "--drift-tokens", "256"]):
        config, _ = cli._bench_config(parser.parse_args(["bench", "--device", "cpu", *extra]))
        names[" ".join(extra)] = (config.workload, config.drift_tokens)
    assert names == {
        "": ("planted", None),
        "--needle": ("needle", None),
        "--drift-tokens 256": ("drifting", 256.0),
        "--needle --drift-tokens 256": ("drifting-needle", 256.0),
    }


def test_warmup_ms_reaches_the_config_and_defaults_to_zero():
    parser, _ = cli._build_parser()
    config, _ = cli._bench_config(parser.parse_args(["bench", "--device", "cpu"]))
    assert config.warmup_ms == 0.0
    config, _ = cli._bench_config(parser.parse_args(["bench", "--device", "cpu", "--warmup-ms", "1500"]))
    assert config.warmup_ms == 1500.0


def test_cpu_defaults_are_small_and_announced():
    parser, _ = cli._build_parser()
    config, notices = cli._bench_config(parser.parse_args(["bench", "--device", "cpu"]))
    assert (config.batch, config.seqlen, config.q_heads, config.kv_heads, config.head_dim) == (1, 4096, 8, 2, 64)
    assert config.dtype == "fp32" and config.min_sparse_kv_len == 0 and config.repeats < 10
    assert notices and "no GPU" in notices[0]
    # Explicit sizes are honoured and silence the notice.
    config, notices = cli._bench_config(
        parser.parse_args(["bench", "--device", "cpu", "-L", "2048", "--dtype", "bf16"])
    )
    assert config.seqlen == 2048 and config.dtype == "bf16" and config.q_heads == 8 and not notices


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "--q-heads", "6", "--kv-heads", "4"], "multiple of --kv-heads"),
        (["bench", "--alpha", "0"], "--alpha must lie in"),
        (["bench", "--alpha", "1.5"], "--alpha must lie in"),
        (["bench", "--head-dim", "100"], "--head-dim must be one of"),
        (["bench", "-L", "0"], "--seqlen must be >= 1"),
        (["bench", "--fraction", "0"], "--fraction"),
        (["bench", "--heatmap-head", "2", "--kv-heads", "2"], "--heatmap-head"),
        (["bench", "--backend", "nope"], "choose one of: auto, hopper, triton, reference"),
        (["bench", "--strategy", "nope"], "--strategy 'nope' is unknown"),
        (["bench", "--no-correction", "--ablation"], "exclude each other"),
        (["bench", "--mass-shift", "third"], "--mass-shift 'third' is unknown"),
        (["bench", "--no-correction", "--mass-shift", "second_order"], "drop --no-correction"),
        (["bench", "--warmup-ms", "-1"], "--warmup-ms must be a finite number >= 0"),
        (["bench", "--warmup-ms", "nan"], "--warmup-ms must be a finite number >= 0"),
        (["bench", "--warmup-ms", "inf"], "--warmup-ms must be a finite number >= 0"),
        (["bench", "--drift-tokens", "0"], "--drift-tokens must be a finite number of tokens > 0"),
        (["bench", "--drift-tokens", "nan"], "--drift-tokens must be a finite number of tokens > 0"),
        (["bench", "--drift-tokens=-inf"], "--drift-tokens must be a finite number of tokens > 0"),
        (["bench", "--dtype", "int8"], "invalid choice"),
        (["bench", "--cache-layout", "sglang"], "invalid choice"),
        (["bench", "-L", "many"], "invalid int value"),
        (["bench", "--device", "tpu:0"], "--device"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args, message, capsys, tmp_path):
    assert main([*args, "--out", str(tmp_path)] if args and args[0] == "bench" else args) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_device_without_cuda_exits_2(capsys):
    assert main(["bench", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_named_unavailable_backend_exits_1(capsys, tmp_path):
    ok, _ = registry.HopperBackend().available()
    if ok:
        pytest.skip("the Hopper kernel is available here")
    assert main(["bench", *TINY_RUN, "--backend", "hopper", "--out", str(tmp_path)]) == 1
    assert "'hopper' is not available" in capsys.readouterr().err


def test_bench_sparse_only_times_no_dense_run_and_leaves_the_speedup_empty(tmp_path, capsys, monkeypatch):
    from fpv2.serving import bench

    def no_baselines(*args, **kwargs):
        raise AssertionError("--sparse-only builds no SDPA baseline")

    monkeypatch.setattr(bench, "sdpa_baselines", no_baselines)
    code = main(["bench", *TINY_RUN, "--sparse-only", "--ablation", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    payload = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    assert payload["config"]["sparse_only"] is True
    assert any("sparse runs only" in note for note in payload["notes"])
    impls = [r["impl"] for r in payload["rows"]]
    assert impls == ["fpv2-sparse/reference", "fpv2-index", "fpv2-sparse/reference", "fpv2-index"]
    sparse = [r for r in payload["rows"] if r["impl"] == "fpv2-sparse/reference"]
    assert [r["correction"] for r in sparse] == [True, False]
    for r in sparse:  # timed and checked as usual; only the dense comparison is absent
        assert r["ms"] > 0 and r["rel_err"] < 0.2 and 0.0 < r["density"] <= 1.0
        assert r["speedup"] is None and r["dense_scaled_ms"] is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary) == 4 and all(r["speedup"] is None for r in summary if r["impl"] != "fpv2-index")
    assert "fpv2-dense" not in captured.out
