#!/usr/bin/env python3
"""Summarise an Nsight Compute source-page CSV (``ncu --page source --csv``): hottest instructions.

Prints the instructions with the most warp-stall samples and those with the most excessive global
sectors, with their share of the kernel's total. The column names differ between ncu versions, so
columns are found by substring.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys


def _read_rows(path: str) -> list[dict[str, str]]:
    text = open(path, encoding="utf-8", errors="replace").read().splitlines()
    # Skip ncu's preamble (==PROF== lines, kernel headers) up to the header row of the table.
    for start, line in enumerate(text):
        if line.startswith('"') and ("Source" in line or "Address" in line):
            return list(csv.DictReader(io.StringIO("\n".join(text[start:]))))
    raise SystemExit(f"{path}: no table header found")


def _column(rows: list[dict[str, str]], *needles: str) -> str | None:
    for needle in needles:
        for name in rows[0]:
            if needle.lower() in name.lower():
                return name
    return None


def _number(value: str | None) -> float:
    try:
        return float((value or "").replace(",", ""))
    except ValueError:
        return 0.0


def _top(rows, key: str, label: str, count: int, extra: list[str]) -> None:
    total = sum(_number(r.get(key)) for r in rows)
    print(f"--- top {count} by {label} (column {key!r}, total {total:.0f})")
    if total <= 0:
        return
    source = _column(rows, "Source") or key
    address = _column(rows, "Address")
    ranked = sorted(rows, key=lambda r: _number(r.get(key)), reverse=True)[:count]
    for r in ranked:
        value = _number(r.get(key))
        cells = " ".join(f"{c.split('(')[0].strip()[:18]}={r.get(c, '')}" for c in extra if c)
        where = r.get(address, "") if address else ""
        print(f"{100 * value / total:5.1f}%  {where}  {r.get(source, '')[:90]}  {cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("csv_path")
    parser.add_argument("--count", type=int, default=60)
    args = parser.parse_args()
    rows = _read_rows(args.csv_path)
    if not rows:
        print("empty table")
        return 1
    print("columns:", " | ".join(rows[0].keys()))
    stalls = _column(rows, "Warp Stall Sampling (All", "Sampling (All", "stall")
    executed = _column(rows, "Instructions Executed", "inst_executed")
    excessive = _column(rows, "Sectors Global Excessive", "Excessive")
    if stalls:
        _top(rows, stalls, "stall samples", args.count, [executed])
    if excessive:
        _top(rows, excessive, "excessive global sectors", 15, [executed])
    return 0


if __name__ == "__main__":
    sys.exit(main())
