"""The committed device record, ``benchmarks/results/h200-summary.json``, keeps BENCHMARKS.md's flat format.

Every record has the protocol's keys with their JSON types (:func:`fpv2.serving.report.check_summary_record`),
a stable ``impl`` name, and numbers that can be true (positive times, densities in (0, 1], errors >= 0). Runs from
a repository checkout only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fpv2.serving.report import check_summary_record

SUMMARY = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "h200-summary.json"
#: BENCHMARKS.md's stable impl names; a backend suffix (``fpv2-sparse/hopper``) may follow the fpv2 ones.
IMPLS = ("fpv2-dense", "fpv2-sparse", "fpv2-index", "torch-sdpa-flash", "torch-sdpa-cudnn", "flex-blocksparse")


def _records() -> list[dict]:
    if not SUMMARY.is_file():
        pytest.skip("benchmarks/results/h200-summary.json is not in this checkout")
    records = json.loads(SUMMARY.read_text(encoding="utf-8"))
    assert isinstance(records, list) and records
    return records


def test_every_record_has_the_protocol_keys_and_types():
    for i, record in enumerate(_records()):
        try:
            check_summary_record(record)
        except ValueError as exc:
            raise AssertionError(f"record {i}: {exc}") from None


def test_impl_names_dtypes_and_values_are_plausible():
    for i, r in enumerate(_records()):
        where = f"record {i} ({r['impl']}, B={r['B']}, L={r['L']})"
        assert r["impl"].split("/")[0] in IMPLS, where
        assert r["dtype"] in ("bf16", "fp8", "fp16"), where
        assert r["ms"] > 0 and r["tflops"] >= 0, where
        assert r["B"] >= 1 and r["L"] >= 1 and r["Hq"] % r["Hkv"] == 0 and r["page_size"] >= 1, where
        if r["density"] is not None:
            assert 0.0 < r["density"] <= 1.0, where
        if r["rel_err"] is not None:
            assert r["rel_err"] >= 0.0, where
        if r["index_ms"] is not None:
            assert r["index_ms"] > 0, where
