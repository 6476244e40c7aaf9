"""Benchmark records: the flat summary of BENCHMARKS.md, the results JSON and the console table."""

from __future__ import annotations

import json
import math
from pathlib import Path

#: Keys every summary record carries, with their JSON types (None allowed where listed).
SUMMARY_KEYS: dict[str, tuple[type, ...]] = {
    "impl": (str,),
    "dtype": (str,),
    "B": (int,),
    "L": (int,),
    "Hq": (int,),
    "Hkv": (int,),
    "d": (int,),
    "page_size": (int,),
    "workload": (str,),
    "ms": (float,),
    "index_ms": (float, type(None)),
    "correction": (bool,),
    "density": (float, type(None)),
    "rel_err": (float, type(None)),
    "tflops": (float,),
    "commit": (str,),
    "gpu": (str,),
}
#: Extra keys copied into the summary when a row has them.
SUMMARY_EXTRAS = (
    "alpha",
    "strategy",
    "speedup",
    "needle_rel_err",
    "correction_ms",
    "attention_ms",
    "timer",
    "gpu_ms",
    "gpu_index_ms",
    "gpu_correction_ms",
    "gpu_attention_ms",
    "gpu_speedup",
    "kv_layout",
    "mass_shift",
)


def check_summary_record(record: dict[str, object]) -> None:
    """Check one summary record against :data:`SUMMARY_KEYS`.

    Args:
        record: the flat record.

    Raises:
        ValueError: a key is missing or has the wrong type.
    """
    for key, types in SUMMARY_KEYS.items():
        if key not in record:
            raise ValueError(f"summary record lacks {key!r}: {record}")
        value = record[key]
        # bool is an int subclass: keep the int columns free of bools.
        if isinstance(value, bool) and bool not in types:
            raise ValueError(f"summary record key {key!r} must be {types}, got bool")
        if not isinstance(value, types):
            raise ValueError(f"summary record key {key!r} must be {types}, got {type(value).__name__}")


def summary_record(row: dict[str, object]) -> dict[str, object]:
    """The flat summary record of one result row (required keys first, then known extras).

    Args:
        row: a result row holding at least the :data:`SUMMARY_KEYS`.

    Returns:
        The checked summary record.
    """
    record = {key: row[key] for key in SUMMARY_KEYS}
    record.update({key: row[key] for key in SUMMARY_EXTRAS if key in row})
    check_summary_record(record)
    return record


def _finite(value: object) -> object:
    """JSON has no NaN/inf: map them to None (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def write_json(path: Path, payload: object) -> Path:
    """Write ``payload`` as indented JSON (non-finite floats become null).

    Args:
        path: output file; parent folders are created.
        payload: JSON-serialisable data.

    Returns:
        ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n")
    return path


def _correction_cell(row: dict[str, object]) -> str:
    """``on`` / ``off`` for a sparse row's correction (``2nd`` with the second-order mass shift), else ``-``."""
    if not str(row["impl"]).startswith("fpv2-sparse"):
        return "-"
    if row.get("correction") and row.get("mass_shift") == "second_order":
        return "2nd"
    return _fmt(row.get("correction"), "")


def _fmt(value: object, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return format(value, spec)


def render_table(rows: list[dict[str, object]], *, title: str) -> object:
    """A rich table of the result rows.

    Args:
        rows: the result rows.
        title: table title.

    Returns:
        A ``rich.table.Table``.
    """
    from rich.table import Table

    table = Table(title=title)
    for header in (
        "impl",
        "alpha",
        "corr",
        "ms",
        "GPU ms",
        "index",
        "corr ms",
        "attn",
        "density",
        "rel err",
        "speedup",
        "TFLOP/s",
    ):
        table.add_column(header, justify="left" if header == "impl" else "right")
    for row in rows:
        table.add_row(
            str(row["impl"]),
            _fmt(row.get("alpha"), ".4g"),
            _correction_cell(row),
            _fmt(row.get("ms"), ".3f"),
            _fmt(row.get("gpu_ms"), ".3f"),
            _fmt(row.get("index_ms"), ".3f"),
            _fmt(row.get("correction_ms"), ".3f"),
            _fmt(row.get("attention_ms"), ".3f"),
            _fmt(row.get("density"), ".3f"),
            _fmt(row.get("rel_err"), ".4f"),
            _fmt(row.get("speedup"), ".2f"),
            _fmt(row.get("tflops"), ".1f"),
        )
    return table
