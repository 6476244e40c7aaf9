#!/usr/bin/env python3
"""Compare Nsight Compute source pages by CUDA line: where each profiled launch spends its stall samples.

Input: CSVs of ``ncu --import <report> --page source --csv --print-source cuda,sass`` (one per launch, same
binary). Output: the hottest lines over all inputs, each with its share of that launch's samples and the
sample count, so that launches of different lengths (dense, sparse, corrected) can be set side by side.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys


def load_lines(path: str, column: str | None = None) -> dict[tuple[str, int], tuple[str, float]]:
    """``{(file name, line): (source text, value)}`` of one CSV (CUDA-line rows only).

    The value is the stall-sample column (the fifth), or the column whose header is ``column`` (e.g.
    ``Instructions Executed``), found in each header row.
    """
    lines: dict[tuple[str, int], tuple[str, float]] = {}
    current = ""
    index = 4
    with open(path, encoding="utf-8", errors="replace") as handle:
        for record in csv.reader(handle):
            if record and record[0] == "Line No" and column is not None:
                if column not in record:
                    raise SystemExit(f"{path}: no column {column!r} in the header {record}")
                index = record.index(column)
                continue
            if not record or record[0] in ("Function Name", "Line No", "Kernel Name", ""):
                continue
            if record[0] == "File Path":
                current = os.path.basename(record[1])
                continue
            try:
                samples = float(record[index].replace(",", ""))
            except (IndexError, ValueError):
                continue
            lines[(current, int(record[0]))] = (record[1].strip(), samples)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("csv_paths", nargs="+", help="source-cuda-*.csv of the launches to compare")
    parser.add_argument("--count", type=int, default=55, help="lines to print [55]")
    parser.add_argument("--column", default=None, help="header of the column to rank by [stall samples]")
    args = parser.parse_args()
    data = [load_lines(p, args.column) for p in args.csv_paths]
    totals = [sum(s for _, s in d.values()) or 1.0 for d in data]
    print("launches:", ", ".join(f"{os.path.basename(p)} ({t:.0f} samples)" for p, t in zip(args.csv_paths, totals)))
    keys = set().union(*data)
    ranked = sorted(keys, key=lambda k: -max(d.get(k, ("", 0.0))[1] / t for d, t in zip(data, totals)))
    for key in ranked[: args.count]:
        text = next(d[key][0] for d in data if key in d)
        shares = "  ".join(
            f"{100 * d.get(key, ('', 0.0))[1] / t:5.1f}%/{d.get(key, ('', 0.0))[1]:7.0f}" for d, t in zip(data, totals)
        )
        print(f"{key[0][:22]:22s}:{key[1]:<4d} {shares}  | {text[:80]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
