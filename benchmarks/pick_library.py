"""Picks the fastest candidate library of an attention A/B (``attention_switch_probe.py`` JSON lines), if any wins.

Each line is one process: a library's label, the sequence length, the correction mode and the median
milliseconds of its one setting. Per label and (length, mode) the median over the rounds is taken; a candidate
wins when, against the baseline label, it is at least ``--min-gain`` faster on the deciding row (``--decide``,
``SEQLEN:MODE``) and no row is more than ``--max-loss`` slower. Of several winners the fastest on the deciding row
is printed, as ``LABEL=FOLDER`` from the ``LABEL=FOLDER`` arguments, so that a device script can run the landing
checks on it in the same call; nothing is printed when none wins. The per-row ratios go to stderr.

Usage: ``python benchmarks/pick_library.py attention-ab.jsonl --baseline shipped half=.carry/half ...``
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys


def row_medians(lines: list[str]) -> dict[str, dict[tuple[int, str], float]]:
    """Median over the rounds of each label's per-process medians, keyed by (sequence length, mode)."""
    samples: dict[str, dict[tuple[int, str], list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        (median,) = record["median_ms"].values()  # one setting per process
        samples[record["label"]][(int(record["seqlen"]), record["mode"])].append(float(median))
    return {label: {row: statistics.median(values) for row, values in rows.items()} for label, rows in samples.items()}


def pick(
    medians: dict[str, dict[tuple[int, str], float]],
    baseline: str,
    candidates: list[str],
    decide: tuple[int, str],
    min_gain: float,
    max_loss: float,
) -> tuple[str | None, dict[str, dict[tuple[int, str], float]]]:
    """The winning candidate (or None) and every candidate's time ratio to the baseline per row."""
    if baseline not in medians:
        raise ValueError(f"baseline label {baseline!r} has no rows (labels: {sorted(medians)})")
    base = medians[baseline]
    if decide not in base:
        raise ValueError(f"deciding row {decide} is not among the baseline's rows {sorted(base)}")
    ratios: dict[str, dict[tuple[int, str], float]] = {}
    best, best_ratio = None, 1.0 - min_gain
    for label in candidates:
        rows = medians.get(label, {})
        ratios[label] = {row: rows[row] / base[row] for row in base if row in rows}
        if decide not in ratios[label] or any(r > 1.0 + max_loss for r in ratios[label].values()):
            continue
        if ratios[label][decide] <= best_ratio:
            best, best_ratio = label, ratios[label][decide]
    return best, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="JSON lines of attention_switch_probe.py, one library per process")
    parser.add_argument("candidates", nargs="+", help="LABEL=FOLDER of each candidate library")
    parser.add_argument("--baseline", default="shipped", help="label of the library to beat [shipped]")
    parser.add_argument("--decide", default="131072:mean", help="SEQLEN:MODE row that decides [131072:mean]")
    parser.add_argument("--min-gain", type=float, default=0.015, help="fraction faster to win [0.015]")
    parser.add_argument("--max-loss", type=float, default=0.01, help="fraction slower allowed on other rows [0.01]")
    args = parser.parse_args()
    folders = {}
    for item in args.candidates:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            parser.error(f"candidate {item!r}: expected LABEL=FOLDER")
        folders[label] = folder
    seqlen, sep, mode = args.decide.partition(":")
    if not sep or not seqlen.isdigit():
        parser.error(f"--decide {args.decide!r}: expected SEQLEN:MODE, e.g. 131072:mean")
    with open(args.results) as f:
        medians = row_medians(f.readlines())
    best, ratios = pick(medians, args.baseline, list(folders), (int(seqlen), mode), args.min_gain, args.max_loss)
    for label, rows in ratios.items():
        text = ", ".join(f"{s} {m} {r:.3f}" for (s, m), r in sorted(rows.items()))
        print(f"{label} / {args.baseline}: {text}", file=sys.stderr)
    print(f"winner: {best or 'none'}", file=sys.stderr)
    if best:
        print(f"{best}={folders[best]}")


if __name__ == "__main__":
    main()
