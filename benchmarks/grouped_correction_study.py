"""Fewer pooled keys: the mean correction with runs of G todo blocks merged into one pooled term.

The correction's cost is one pooled column per todo block, ``1 / (rho Bk)`` of the kept keys' work
(ALGORITHM.md section 8: ~25% at 3.5% density), the floor under issue 4's and 5's overhead targets.
Merging aligned groups of ``G`` consecutive blocks (``J // G`` equal) into one term when *every*
member is a todo block of the tile (eligible and not kept) divides the pooled columns by up to ``G``:
the merged term's key and value are the members' means (eligible blocks are full, so equal weights)
and its logit shift is ``log(G * Bk)``. Groups with a kept or non-eligible member keep one term per
todo member, as today. ``G = 1`` is the landed method.

By Jensen's inequality a merged term never overstates its group's softmax mass, and it understates
it by more than the per-block terms do when the members' scores differ (one near-threshold block
merged with low ones). So the question is the error on inputs whose blocks differ:

- ``planted``: ``fpv2 bench``'s workload (i.i.d. keys, planted blocks); pooled keys are near zero,
  so merging should cost almost nothing here: the easy case;
- ``drifting``: the planted workload on the drifting background
  (:mod:`fpv2.kernel.testing.drifting`: keys, values and queries follow an AR(1) process with a
  correlation length of ``--drift-tokens``, keys and queries share a per-head mean, RoPE rotates
  both). Neighbouring blocks' pooled scores then differ: the hard case.

For each workload, length and alpha it prints and records the relative L2 error against fp32 dense
attention without correction and with the correction at each ``G``, and the pooled columns as a share
of the kept keys (the correction's work relative to the sparse attention); writes the JSON and a plot.
CPU-only (the PyTorch reference); 16K with 8/2 heads takes a few minutes per (workload, alpha).

Usage (the four packages' ``src`` on ``PYTHONPATH``):
``python benchmarks/grouped_correction_study.py --seqlen 8192 16384 --groups 1 2 4 8 --out OUT``
"""

from __future__ import annotations

import argparse
import bisect
from pathlib import Path
from unittest import mock

import torch
from correction_study_common import record_header, run_grid, save_figure, study_inputs, study_parser, workload_panels

from fpv2.index import SelectionConfig
from fpv2.kernel.reference import sparse as reference_sparse
from fpv2.kernel.reference.attention import dense_attention
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.pipeline import SparsePrefillPipeline


class GroupedPseudoKeys:
    """A stand-in for the reference's ``_pseudo_keys`` that merges full groups of ``group`` todo blocks."""

    def __init__(self, group: int, block_offsets: list[int]) -> None:
        self.group = group
        self.block_offsets = block_offsets
        self.columns = 0  # pooled columns emitted over the call
        self.blocks = 0  # todo blocks they stand for

    def __call__(self, rows, stats, stat_rows, kv_head, scale):
        """Pooled logits and values of one tile, one column per merged group or unmerged todo block."""
        request = bisect.bisect_right(self.block_offsets, stat_rows[0]) - 1
        base = self.block_offsets[request]
        members: dict[int, list[int]] = {}
        for row in stat_rows:
            members.setdefault((row - base) // self.group, []).append(row)
        columns = []  # (statistics rows, tokens they stand for)
        for rows_of_group in members.values():
            if len(rows_of_group) == self.group:
                columns.append(rows_of_group)
            else:
                columns.extend([row] for row in rows_of_group)
        dtype = rows.dtype
        keys = torch.stack([stats.pooled_k[c, kv_head].to(dtype).mean(dim=0) for c in columns])
        values = torch.stack([stats.pooled_v[c, kv_head].to(dtype).mean(dim=0) for c in columns])
        tokens = torch.tensor([float(stats.block_lengths[c].sum()) for c in columns], dtype=dtype)
        self.columns += len(columns)
        self.blocks += len(stat_rows)
        return (rows @ keys.T) * scale + torch.log(tokens)[None, :], values


def study(workload: str, seqlen: int, alpha: float, args: argparse.Namespace) -> dict[str, object]:
    """Errors of one (workload, length, alpha): no correction and the correction at each group size."""
    q, k, v, batch = study_inputs(workload, seqlen, args)
    dense = dense_attention(q, k, v, batch, compute_dtype=torch.float32)
    result = SparsePrefillPipeline(SelectionConfig(alpha=alpha), backend="reference")(q, k, v, batch)
    index, plan = result.index, result.plan
    kept_keys = int(index.offsets[-1] - index.offsets[0]) * index.block_size
    uncorrected = reference_sparse.sparse_attention(q, k, v, batch, index)
    record = record_header(workload, seqlen, alpha, args, index.density(batch))
    record["rel_err_uncorrected"] = relative_l2_error(uncorrected, dense)
    record["groups"] = []
    line = f"{workload} L={seqlen} alpha={alpha} density {record['density']:.3f}"
    line += f": no corr {record['rel_err_uncorrected']:.4f}"
    for group in args.groups:
        grouped = GroupedPseudoKeys(group, plan.statistics.block_offsets.tolist())
        with mock.patch.object(reference_sparse, "_pseudo_keys", grouped):
            out = reference_sparse.sparse_attention(q, k, v, batch, index, plan=plan)
        err = relative_l2_error(out, dense)
        record["groups"].append(
            {
                "G": group,
                "rel_err": err,
                "pooled_columns": grouped.columns,
                "todo_blocks": grouped.blocks,
                # Per segment the kept keys and the pooled columns serve the same rows.
                "pooled_share_of_kept_keys": grouped.columns / max(kept_keys, 1),
            }
        )
        line += f", G={group} {err:.4f} ({grouped.columns / max(kept_keys, 1):.1%} of kept keys)"
    print(line, flush=True)
    return record


def plot(records: list[dict[str, object]], path: Path) -> None:
    """Error against the pooled columns' share of the kept keys, one panel per workload, a point per G."""
    fig, panels = workload_panels(records, 6)
    for ax, workload, rows in panels:
        for r in rows:
            share = [100 * g["pooled_share_of_kept_keys"] for g in r["groups"]]
            err = [g["rel_err"] for g in r["groups"]]
            (line,) = ax.plot(share, err, marker="o", label=f"L={r['L']}, alpha={r['alpha']}")
            ax.axhline(r["rel_err_uncorrected"], color=line.get_color(), linestyle=":", linewidth=1)
            for g, x, y in zip(r["groups"], share, err):
                ax.annotate(f"G={g['G']}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ax.set_title(f"{workload}: error vs dense (dotted: no correction)")
        ax.set_xlabel("pooled columns, % of the kept keys (the correction's share of the work)")
        ax.set_ylabel("relative L2 error vs fp32 dense")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    """Run the study for every (workload, length, alpha) and write the JSON and the plot under ``--out``."""
    parser = study_parser(__doc__, seqlen=8192, q_heads=16, kv_heads=4, out="grouped-correction-study")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    if any(g < 1 for g in args.groups):
        parser.error("--groups must be positive integers")
    run_grid(study, args, "grouped-correction-study", plot)


if __name__ == "__main__":
    main()
