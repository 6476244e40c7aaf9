"""``benchmarks/transformers_long_prefill.py`` as a CPU dry run: tiny random Llama, fp32, the reference backend.

The script's numbers come from the GPU; here only its plumbing is checked: both
implementations run, the adapter's counters and densities reach the JSON, the
agreement and errors are sane, and ``--time-limit`` and running out of memory skip lengths.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "transformers_long_prefill.py"
# Head dim 64, GQA 4/2; small sinks and windows and no minimum length, so that 768 tokens have blocks to prune.
TINY = ["--device", "cpu", "--dtype", "fp32", "--hidden-size", "256", "--q-heads", "4", "--kv-heads", "2"]
TINY += ["--head-dim", "64", "--intermediate-size", "512", "--vocab-size", "256", "--min-sparse-kv-len", "0"]
TINY += ["--sink-tokens", "128", "--window-tokens", "128", "--repeats", "1", "--warmup", "1", "--tail", "128"]


def _load_script():
    if not SCRIPT.exists():
        pytest.skip("benchmarks/transformers_long_prefill.py is not in this checkout")
    spec = importlib.util.spec_from_file_location("transformers_long_prefill", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results(folder: Path) -> dict:
    (path,) = folder.glob("transformers-long-prefill-*.json")
    return json.loads(path.read_text())


def test_dry_run_writes_sane_rows(tmp_path, capsys):
    script = _load_script()
    # --init-std 0.3 makes the random attention peaked enough for the selector to prune (0.02 keeps every block).
    args = [*TINY, "--seqlens", "768", "128", "--init-std", "0.3", "--out", str(tmp_path)]
    assert script.main(args) == 0
    doc = _results(tmp_path)
    assert doc["benchmark"] == "transformers_long_prefill" and doc["complete"] and doc["skipped"] == []
    assert doc["commit"] and doc["environment"]["commit"] and doc["transformers"]
    assert doc["fpv2"]["backend"] == "reference" and doc["fpv2"]["strategy"] == "max_threshold"
    assert doc["fpv2"]["correction"] and doc["fpv2"]["selection"]["alpha"] == 0.1
    assert doc["model"]["weights"] == "random" and doc["model"]["initializer_range"] == 0.3
    assert doc["timer"] == "perf_counter" and doc["notes"][0].startswith("CPU dry run")
    assert [r["L"] for r in doc["rows"]] == [128, 768]  # run shortest first
    for row in doc["rows"]:
        assert row["sdpa_ms"] > 0 and row["fpv2_ms"] > 0 and len(row["sdpa_samples_ms"]) == 1
        assert math.isclose(row["speedup"], row["sdpa_ms"] / row["fpv2_ms"])
        stages = row["fpv2_stages_ms"]
        assert 0 < stages["pipeline_ms"] and stages["index_ms"] >= 0 and stages["attention_ms"] > 0
        # One pipeline call per layer and forward, nothing sent to sdpa.
        assert row["pipeline_calls"] == 2 and row["pipeline_calls_timed"] == 2 * (1 + 1)
        assert row["fallbacks"] == {} and row["fallbacks_timed"] == {} and row["fallback_calls"] == 0
        assert len(row["densities"]) == 2 and all(0 < d <= 1 for d in row["densities"])
        assert math.isclose(row["density_mean"], sum(row["densities"]) / 2)
        assert 0 <= row["top1_agreement"] <= 1 and 0 <= row["top1_agreement_tail"] <= 1
        assert row["tail_positions"] == 128
        assert 0 <= row["hidden_rel_err"] < 1 and 0 <= row["logits_rel_err"] < 1
        dense = row["dense_reference"]
        assert dense["pipeline_calls"] == 2 and dense["fallbacks"] == {}
        # fp32 dense mode against fp32 sdpa: the same attention up to rounding.
        assert dense["top1_agreement"] == 1.0 and dense["logits_rel_err"] < 1e-4
    assert min(doc["rows"][1]["densities"]) < 1.0  # the selector pruned something at 768 tokens
    out = capsys.readouterr().out
    assert "| L | sdpa ms | fpv2 ms |" in out and "| 768 |" in out
    assert "CPU dry run" in next(tmp_path.glob("*.md")).read_text()


def test_time_limit_skips_lengths_with_a_message(tmp_path, capsys):
    script = _load_script()
    args = [*TINY, "--seqlens", "256", "512", "--time-limit", "0.001", "--no-dense-reference", "--out", str(tmp_path)]
    assert script.main(args) == 0
    doc = _results(tmp_path)
    assert doc["rows"] == [] and not doc["complete"]
    assert [s["L"] for s in doc["skipped"]] == [256, 512] and "time limit" in doc["skipped"][0]["reason"]
    assert "skipped L=512: time limit" in capsys.readouterr().out


def test_prediction_is_quadratic_in_length():
    script = _load_script()
    args = script.parse_args(["--out", "x"])
    assert script.forwards_per_length(args) == 2 * (2 + 10 + 1) + 1
    previous = {"L": 8192, "sdpa_ms": 100.0, "fpv2_ms": 50.0}
    assert script.predicted_seconds(args, None, 8192) is None
    expected = 27 * 0.075 * 16 + script.PREDICTION_MARGIN_S
    assert math.isclose(script.predicted_seconds(args, previous, 32768), expected)
    with pytest.raises(SystemExit):
        script.parse_args(["--out", "x", "--q-heads", "6", "--kv-heads", "4"])


def test_out_of_memory_skips_that_length_and_keeps_the_others(tmp_path, monkeypatch):
    script = _load_script()
    measure = script.measure_length

    def measure_or_oom(args, device, model, length, log):
        if length == 256:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return measure(args, device, model, length, log)

    monkeypatch.setattr(script, "measure_length", measure_or_oom)
    args = [*TINY, "--seqlens", "128", "256", "--no-dense-reference", "--out", str(tmp_path)]
    assert script.main(args) == 0
    doc = _results(tmp_path)
    assert [r["L"] for r in doc["rows"]] == [128] and not doc["complete"]
    assert doc["skipped"] == [{"L": 256, "reason": "out of memory: CUDA out of memory. Tried to allocate 4.00 GiB"}]
