"""Scoring every ``probe_stride``-th query row: what it does to the index and the accuracy, on the reference.

The index's scoring pass computes one exponential per (query row, candidate block) and one product of the
same size; it is the largest part of the index's time at 128K (1.45 of 1.86 ms on the H200) and runs its
products and exponentials one after the other. ``SelectionConfig(probe_stride=s)`` scores every s-th packed
row of a tile (the Triton pass supports it; the Hopper scoring kernel does not yet), halving both at s = 2.
Whether that is a speed option depends on what it does to the selection, which the planted inputs cannot show
(their planted blocks stand far above the rest). For each workload (``planted``, ``drifting``), length, alpha
and stride, this study runs the corrected pipeline on the PyTorch reference and records: the density, the
relative L2 error against fp32 dense attention with and without the mean correction, and how many kept
(segment, block) pairs the stride adds or drops against stride 1. Writes the JSON and a plot. CPU-only.

Usage (the four packages' ``src`` on ``PYTHONPATH``):
``python benchmarks/probe_stride_study.py --seqlen 16384 --strides 1 2 4 --out OUT``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from correction_study_common import (
    grouped_bars,
    record_header,
    run_grid,
    save_figure,
    study_inputs,
    study_parser,
    workload_panels,
)

from fpv2.index import SelectionConfig
from fpv2.kernel.reference import sparse as reference_sparse
from fpv2.kernel.reference.attention import dense_attention
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.pipeline import SparsePrefillPipeline


def study(workload: str, seqlen: int, alpha: float, args: argparse.Namespace) -> dict[str, object]:
    """Density, errors and index differences of every stride at one (workload, length, alpha)."""
    q, k, v, batch = study_inputs(workload, seqlen, args)
    dense = dense_attention(q, k, v, batch, compute_dtype=torch.float32)
    num_blocks = -(-seqlen // SelectionConfig().block_size)
    base_mask = None
    rows = {}
    for stride in args.strides:
        result = SparsePrefillPipeline(SelectionConfig(alpha=alpha, probe_stride=stride), backend="reference")(
            q, k, v, batch
        )
        mask = result.index.to_dense_mask(num_blocks)
        if base_mask is None:
            base_mask = mask
        rows[str(stride)] = {
            "density": result.index.density(batch),
            "rel_err_mean": relative_l2_error(result.out, dense),
            "rel_err_none": relative_l2_error(reference_sparse.sparse_attention(q, k, v, batch, result.index), dense),
            "pairs_added": int((mask & ~base_mask).sum()),
            "pairs_dropped": int((base_mask & ~mask).sum()),
            "kept_pairs": int(mask.sum()),
        }
        r = rows[str(stride)]
        print(
            f"{workload} L={seqlen} alpha={alpha} stride {stride}: density {r['density']:.4f}, error "
            f"{r['rel_err_mean']:.4f} corrected / {r['rel_err_none']:.4f} not, pairs +{r['pairs_added']} "
            f"-{r['pairs_dropped']} of {r['kept_pairs']}",
            flush=True,
        )
    record = record_header(workload, seqlen, alpha, args, rows[str(args.strides[0])]["density"])
    record["strides"] = rows
    return record


def plot(records: list[dict[str, object]], path: Path) -> None:
    """Corrected error per stride at each (length, alpha), one panel per workload; densities in the labels."""
    fig, panels = workload_panels(records, 6.5)
    for ax, workload, rows in panels:
        strides = list(rows[0]["strides"])
        series = {f"stride {s}": [r["strides"][s]["rel_err_mean"] for r in rows] for s in strides}
        labels = [
            f"{r['L'] // 1024}K a={r['alpha']}\n"
            + "/".join(f"{100 * r['strides'][s]['density']:.1f}" for s in strides)
            + "% kept"
            for r in rows
        ]
        grouped_bars(ax, series, labels, f"{workload}: corrected error vs fp32 dense")
    save_figure(fig, path)


def main() -> None:
    """Run the study for every (workload, length, alpha) and write the JSON and the plot under ``--out``."""
    parser = study_parser(__doc__, seqlen=16384, q_heads=8, kv_heads=2, out="probe-stride-study")
    parser.add_argument("--strides", type=int, nargs="+", default=[1, 2, 4], help="probe strides (the first: base)")
    run_grid(study, parser.parse_args(), "probe-stride-study", plot)


if __name__ == "__main__":
    main()
