"""The mean correction with a second-order mass shift: accuracy on the reference.

The mean correction weighs a pruned block by ``|B_J| exp(q . kbar_J * scale)``, which by Jensen's
inequality understates the block's mass ``sum_i exp(q . k_i * scale)``. The shift of
:func:`fpv2.correction.key_spread.second_order_shift`, ``min(scale^2 |q|^2 sigma2_J / 2,
scale |q| rho_J)`` (the block's per-dimension key variance and its radius), estimates that mass to second
order and never past the block's largest possible mass. It costs a kernel one per-row and two per-column
scalars a pooled column, no product.

For each workload (``planted``: BENCHMARKS.md's; ``drifting``: the same on the drifting background of
:mod:`fpv2.kernel.testing.drifting`), length and alpha it prints and records the relative L2 error against
fp32 dense attention of: no correction, the mean correction (the landed method), the shifted one
(``second_order``), the shift without its cap (``uncapped``), and with per-dimension variances instead of
their mean (``diagonal``: ``scale^2 sum_c q_c^2 sigma2_Jc / 2``, a product per pooled step; the
isotropic shift's upper reference). ``--outlier-channels N`` multiplies the keys' first N channels by
``--outlier-scale`` (anisotropic keys, where the isotropic and diagonal shifts part); ``--shift-cap C``
adds the isotropic shift clamped at ``C`` nats (``capped_C``). Writes the JSON and a plot.
CPU-only (the PyTorch reference).

Usage (the four packages' ``src`` on ``PYTHONPATH``):
``python benchmarks/second_order_correction_study.py --seqlen 16384 32768 --q-heads 8 --kv-heads 2 --out OUT``
"""

from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

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

from fpv2.correction.key_spread import compute_key_spread, second_order_shift
from fpv2.index import SelectionConfig
from fpv2.kernel.reference import sparse as reference_sparse
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.reference.paged import gather_kv
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.pipeline import SparsePrefillPipeline

_pseudo_keys = reference_sparse._pseudo_keys


def channel_variance(k: torch.Tensor, batch, stats) -> torch.Tensor:
    """``(total_blocks, Hkv, d)`` per-dimension key variance of every block (one request per batch here)."""
    keys = gather_kv(k, batch, 0)
    block = stats.block_size
    nblocks = stats.pooled_k.shape[0]
    token_block = torch.arange(keys.shape[0]) // block
    dev2 = (keys - stats.pooled_k[token_block]).pow(2)
    sums = torch.zeros(nblocks, *keys.shape[1:]).index_add_(0, token_block, dev2)
    return sums / torch.bincount(token_block, minlength=nblocks).float()[:, None, None]


def shifted(kind: str, spread, channel_var, cap: float | None = None):
    """A stand-in for the reference's ``_pseudo_keys`` that adds the ``kind`` shift to the pooled logits."""

    def pseudo_keys(rows, stats, stat_rows, kv_head, scale):
        logits, values = _pseudo_keys(rows, stats, stat_rows, kv_head, scale)
        idx = torch.tensor(stat_rows, dtype=torch.long)
        if kind == "second_order":
            shift = second_order_shift(rows, spread, idx, kv_head, scale)
        elif kind == "capped":
            shift = second_order_shift(rows, spread, idx, kv_head, scale).clamp(max=cap)
        elif kind == "uncapped":
            shift = 0.5 * scale * scale * rows.pow(2).sum(1, keepdim=True) * spread.variance[idx, kv_head][None, :]
        else:  # diagonal
            shift = 0.5 * scale * scale * (rows.pow(2) @ channel_var[idx, kv_head].T)
        return logits + shift, values

    return pseudo_keys


def study(workload: str, seqlen: int, alpha: float, args: argparse.Namespace) -> dict[str, object]:
    """Errors of one (workload, length, alpha)."""
    q, k, v, batch = study_inputs(workload, seqlen, args)
    if args.outlier_channels:
        # Anisotropic keys (a stress for the isotropic shift): a few channels spread wider than the rest.
        k[..., : args.outlier_channels] *= args.outlier_scale
    dense = dense_attention(q, k, v, batch, compute_dtype=torch.float32)
    result = SparsePrefillPipeline(SelectionConfig(alpha=alpha), backend="reference")(q, k, v, batch)
    index, plan = result.index, result.plan
    spread = compute_key_spread(k, batch, plan.statistics)
    channel_var = channel_variance(k, batch, plan.statistics)
    errors = {
        "none": relative_l2_error(reference_sparse.sparse_attention(q, k, v, batch, index), dense),
        "mean": relative_l2_error(reference_sparse.sparse_attention(q, k, v, batch, index, plan=plan), dense),
    }
    kinds = ("second_order", "uncapped", "diagonal") + (("capped",) if args.shift_cap is not None else ())
    for kind in kinds:
        with mock.patch.object(reference_sparse, "_pseudo_keys", shifted(kind, spread, channel_var, args.shift_cap)):
            out = reference_sparse.sparse_attention(q, k, v, batch, index, plan=plan)
        errors[f"capped_{args.shift_cap:g}" if kind == "capped" else kind] = relative_l2_error(out, dense)
    record = record_header(workload, seqlen, alpha, args, index.density(batch))
    record["rel_err"] = errors
    record["mean_key_variance"] = float(spread.variance.mean())
    record["outlier_channels"] = args.outlier_channels
    record["outlier_scale"] = args.outlier_scale
    print(
        f"{workload} L={seqlen} alpha={alpha} density {record['density']:.3f}: "
        + ", ".join(f"{name} {err:.4f}" for name, err in errors.items()),
        flush=True,
    )
    return record


def plot(records: list[dict[str, object]], path: Path) -> None:
    """Error of each variant per (length, alpha, density), one panel per workload."""
    variants = ("none", "mean", "second_order", "diagonal")
    fig, panels = workload_panels(records, 6.5)
    for ax, workload, rows in panels:
        series = {variant: [r["rel_err"][variant] for r in rows] for variant in variants}
        labels = [f"{r['L'] // 1024}K a={r['alpha']}\n{100 * r['density']:.1f}% kept" for r in rows]
        grouped_bars(ax, series, labels, f"{workload}: relative L2 error vs fp32 dense")
    save_figure(fig, path)


def main() -> None:
    """Run the study for every (workload, length, alpha) and write the JSON and the plot under ``--out``."""
    parser = study_parser(__doc__, seqlen=16384, q_heads=8, kv_heads=2, out="second-order-correction-study")
    parser.add_argument("--outlier-channels", type=int, default=0, help="scale the keys' first N channels")
    parser.add_argument("--outlier-scale", type=float, default=4.0, help="the factor of --outlier-channels")
    parser.add_argument(
        "--shift-cap", type=float, help="also run the isotropic shift clamped at this many nats (variant capped_N)"
    )
    run_grid(study, parser.parse_args(), "second-order-correction-study", plot)


if __name__ == "__main__":
    main()
