"""The mean correction as *all* eligible pooled terms minus the kept ones: its numerics on the reference.

The numerics of the fused designs (a) and (b) of benchmarks/NOTES.md's nineteenth session: the index's scoring pass
already computes the logit ``s_rJ = q_r . kbar_J * scale`` of every row and every eligible block and exponentiates
it. If it also accumulated the pooled terms of all eligible blocks,

    l_all_r = sum_J |B_J| exp(s_rJ - c_r),   O_all_r = sum_J |B_J| exp(s_rJ - c_r) vbar_J

(one more product a step and no more exponentials), the attention kernel would only subtract the pooled terms of
the few eligible blocks it keeps, instead of computing one pooled column per todo block (today ~4.5 pooled
tiles a CTA at 128K, +25% of the attention kernel). In exact arithmetic that is today's correction. What the
kernels' numerics make of it is measured here, on the PyTorch reference, against fp32 dense attention:

- ``exact``: fp32 throughout, the aggregate's offset ``c_r`` the row's maximum over all eligible blocks. It
  must equal today's corrected reference to fp32 rounding (checked: the script stops otherwise);
- ``kernel``: as a kernel would do it. The scoring pass takes ``c_r`` from the row's first 64 eligible blocks
  (its first step; later logits may exceed it, which fp32 and bf16 hold up to 2^127), rounds its
  probabilities and the pooled values to bf16 before the product, and stores the aggregate as a bf16
  normalised output ``O_all / l_all`` with an fp32 log-sum-exp. The attention kernel rounds the kept blocks'
  pooled probabilities (against its own row maximum) to bf16 before subtracting them, so the two roundings
  of a kept block's term do not cancel exactly; a denominator that the subtraction takes to zero or below is
  clamped to the exact kept keys' mass (counted).

Design (b) also moves the selection into the attention kernel, which would take each block's energy
from the pooled pass's own probabilities: per step of ``B_STEP_BLOCKS`` pooled columns, ``P_rJ = 2^(s_rJ - m_r)``
against the row's running maximum, rounded to bf16, summed over the tile's rows with bf16 weights
``2^(m_r - M)`` (``M`` the step's largest ``m_r``). ``b_energies`` runs the reference pipeline with those energies
in place of the exact ones and records how many kept (segment, block) pairs change and the corrected error then.

For each workload, length and alpha it prints and records the density, the relative L2 error against dense
of no correction, today's correction and both variants, the variants' distance to today's corrected output,
the largest ``max_J s_rJ - c_r`` (how far a later block rises above the first step's offset) and the clamped
rows; writes the JSON and a plot. CPU-only; 16K with 8/2 heads takes a few minutes per (workload, alpha).

Usage (the four packages' ``src`` on ``PYTHONPATH``):
``python benchmarks/subtracted_correction_study.py --seqlen 16384 32768 --alpha 0.1 --out OUT``
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from correction_study_common import grouped_bars, record_header, run_grid, save_figure, study_inputs, study_parser

from fpv2.index import SelectionConfig
from fpv2.index.reference import TileEnergies, block_logits, contribution_mask
from fpv2.index.reference import selection as reference_selection
from fpv2.kernel.contracts import (
    BlockIndex,
    BlockStatistics,
    PagedPrefillBatch,
    TileSpan,
    tile_span,
    validate_prefill_inputs,
)
from fpv2.kernel.reference import sparse as reference_sparse
from fpv2.kernel.reference.attention import dense_attention, masked_softmax, request_operands, resolve_scale
from fpv2.kernel.reference.packgqa import pack_queries, packed_rows_to_position_head
from fpv2.kernel.reference.sparse import tile_token_mask
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.pipeline import SparsePrefillPipeline

#: The scoring kernel's step: its first step's logits give the aggregate's offset in the ``kernel`` variant.
FIRST_STEP_BLOCKS = 64
#: Pooled columns per step of the attention kernel's pooled pass (design (b)'s energies).
B_STEP_BLOCKS = 128


def bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 (nearest-even), back in float32."""
    return x.to(torch.bfloat16).float()


@dataclass
class Tally:
    """What the ``kernel`` variant met over a call."""

    clamped_rows: int = 0
    rows: int = 0
    max_rise: float = -math.inf  # largest max_J s_rJ - c_r (natural log units)
    kept_eligible: int = 0  # kept blocks inside the eligible range, summed over tiles
    eligible: int = 0


def subtracted_tile(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    pooled: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kept_eligible: list[int],
    scale: float,
    kernel: bool,
    tally: Tally,
) -> torch.Tensor:
    """One tile's output: exact kept keys, plus the all-eligible aggregate, minus the kept blocks' pooled terms.

    Args:
        rows: ``(R, d)`` fp32 query rows of the tile.
        keys, values: ``(T, d)`` the kept tokens' keys and values; ``allowed (R, T)`` their causal mask.
        pooled: ``(pooled_k (E, d), pooled_v (E, d), log_len (E,))`` of the tile's eligible blocks ``0 .. E-1``.
        kept_eligible: kept block ids below ``E``.
        scale: softmax scale.
        kernel: the kernel's numerics (bf16 roundings, first-step offset) instead of fp32 throughout.
        tally: counters of the call.
    """
    logits = ((rows @ keys.T) * scale).masked_fill(~allowed, -math.inf)
    pooled_k, pooled_v, log_len = pooled
    s_all = (rows @ pooled_k.T) * scale + log_len[None, :]  # (R, E), natural log units

    # The scoring pass: the aggregate of every eligible block, stored as (normalised output, lse).
    offset = s_all[:, :FIRST_STEP_BLOCKS] if kernel else s_all
    offset = offset.amax(dim=1, keepdim=True)
    tally.max_rise = max(tally.max_rise, float((s_all.amax(dim=1, keepdim=True) - offset).max()))
    p_all = torch.exp(s_all - offset)
    v_all = bf16(pooled_v) if kernel else pooled_v
    if kernel:
        p_all = bf16(p_all)
    l_all = p_all.sum(dim=1, keepdim=True)
    o_all = (p_all @ v_all) / l_all
    if kernel:
        o_all = bf16(o_all)
    lse_all = offset + torch.log(l_all)

    # The attention kernel: exact kept keys, the aggregate as one column, the kept eligible blocks' pooled terms
    # with weight -1 (their logits recomputed from the same pooled keys).
    row_max = torch.maximum(logits.amax(dim=1, keepdim=True), lse_all)
    p_exact = torch.exp(logits - row_max)
    weight_all = torch.exp(lse_all - row_max)
    numerator = p_exact @ values + weight_all * o_all
    denominator = p_exact.sum(dim=1, keepdim=True) + weight_all
    if kept_eligible:
        columns = torch.tensor(kept_eligible, dtype=torch.long)
        p_kept = torch.exp(s_all[:, columns] - row_max)
        if kernel:
            p_kept = bf16(p_kept)
        numerator = numerator - p_kept @ v_all[columns]
        denominator = denominator - p_kept.sum(dim=1, keepdim=True)
    exact_mass = p_exact.sum(dim=1, keepdim=True)
    bad = denominator <= exact_mass * 1e-6
    tally.clamped_rows += int(bad.sum())
    tally.rows += rows.shape[0]
    tally.kept_eligible += len(kept_eligible)
    tally.eligible += pooled_k.shape[0]
    # A clamped row keeps its exact keys only (what the kernel would fall back to).
    fallback = (p_exact @ values) / exact_mass.clamp_min(1e-30)
    return torch.where(bad, fallback, numerator / torch.where(bad, torch.ones_like(denominator), denominator))


def subtracted_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: PagedPrefillBatch,
    index: BlockIndex,
    stats: BlockStatistics,
    kernel: bool,
) -> tuple[torch.Tensor, Tally]:
    """Today's corrected attention of the batch, computed as all eligible pooled terms minus the kept ones."""
    shapes = validate_prefill_inputs(q, k, v, batch)
    group, scale = shapes.group, resolve_scale(None, shapes.head_dim)
    out = torch.zeros_like(q)
    tally = Tally()
    tile_offsets = index.tile_offsets.tolist()
    offsets = index.offsets.tolist()
    blocks = index.blocks.tolist()
    block_offsets = stats.block_offsets.tolist()
    host = batch.host
    for b in range(batch.num_requests):
        q_len, prefix, kv_len, start = host.q_lens[b], host.prefix[b], host.seqlens_k[b], host.cu_seqlens_q[b]
        q_b, k_b, v_b = request_operands(q, k, v, batch, b, shapes, torch.float32)
        ntiles = tile_offsets[b + 1] - tile_offsets[b]
        for h in range(shapes.num_kv_heads):
            packed = pack_queries(q_b, group, h)
            for t in range(ntiles):
                s = index.num_kv_heads * tile_offsets[b] + h * ntiles + t
                span: TileSpan = tile_span(
                    t, q_len, prefix, group, tile_size=index.tile_size, block_size=index.block_size
                )
                rows = packed[span.row_begin : span.row_end]
                kept = blocks[offsets[s] : offsets[s + 1]]
                tokens, allowed = tile_token_mask(torch.tensor(kept), span, kv_len, group)
                eligible = span.num_correctable_blocks
                if eligible == 0:
                    tile_out, _ = masked_softmax(
                        ((rows @ k_b[tokens, h].T) * scale).masked_fill(~allowed, -math.inf),
                        v_b[tokens, h],
                    )
                else:
                    stat = torch.arange(eligible) + block_offsets[b]
                    pooled = (
                        stats.pooled_k[stat, h].float(),
                        stats.pooled_v[stat, h].float(),
                        torch.log(stats.block_lengths[stat].float()),
                    )
                    tile_out = subtracted_tile(
                        rows,
                        k_b[tokens, h],
                        v_b[tokens, h],
                        allowed,
                        pooled,
                        [j for j in kept if j < eligible],
                        scale,
                        kernel,
                        tally,
                    )
                positions, heads = packed_rows_to_position_head(torch.arange(span.row_begin, span.row_end), group, h)
                out[start + positions, heads] = tile_out
    return out, tally


class AttentionLayoutEnergies:
    """A stand-in for the reference's ``block_energies`` with design (b)'s numerics (counts its calls)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, rows, row_positions, num_scored, pooled_k, *, scale, block_size) -> TileEnergies:
        """Energies of ``T`` tiles relative to their peak, from bf16 probabilities against running row maxima."""
        self.calls += 1
        num_tiles, num_blocks = rows.shape[0], pooled_k.shape[0]
        logits = block_logits(rows, pooled_k, scale)
        mask = contribution_mask(row_positions, num_scored, 0, num_blocks, block_size)
        logits = torch.where(mask, logits, torch.full_like(logits, -math.inf))
        energies = torch.full((num_tiles, num_blocks), -math.inf)
        running = torch.full(rows.shape[:2], -math.inf)
        for begin in range(0, num_blocks, B_STEP_BLOCKS):
            step = logits[:, :, begin : begin + B_STEP_BLOCKS]
            running = torch.maximum(running, step.amax(dim=2))
            finite = torch.isfinite(running)
            row_max = torch.where(finite, running, torch.zeros_like(running))
            probs = bf16(torch.exp2(step - row_max[:, :, None]))
            peak = torch.where(finite, running, torch.full_like(running, -math.inf)).amax(dim=1, keepdim=True)
            peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
            weights = bf16(torch.where(finite, torch.exp2(row_max - peak), torch.zeros_like(row_max)))
            sums = torch.einsum("tr,trj->tj", weights, probs)
            energies[:, begin : begin + B_STEP_BLOCKS] = peak + torch.log2(sums)
        tile_max = energies.amax(dim=1) if num_blocks else torch.full((num_tiles,), -math.inf)
        shift = torch.where(torch.isfinite(tile_max), tile_max, torch.zeros_like(tile_max))
        return TileEnergies(torch.exp2(energies - shift[:, None]), tile_max)


def kept_pairs(index: BlockIndex) -> set[tuple[int, int]]:
    """The index's (segment, block) pairs."""
    offsets, blocks = index.offsets.tolist(), index.blocks.tolist()
    return {(s, j) for s in range(len(offsets) - 1) for j in blocks[offsets[s] : offsets[s + 1]]}


def b_energies(q, k, v, batch, alpha: float, today_index: BlockIndex, dense: torch.Tensor) -> dict[str, object]:
    """The reference pipeline with design (b)'s energies: changed kept pairs, density and corrected error."""
    energies = AttentionLayoutEnergies()
    with mock.patch.object(reference_selection, "block_energies", energies):
        result = SparsePrefillPipeline(SelectionConfig(alpha=alpha), backend="reference")(q, k, v, batch)
    if energies.calls == 0:
        raise SystemExit("the reference selection did not call block_energies: the patch measured nothing")
    today, other = kept_pairs(today_index), kept_pairs(result.index)
    return {
        "b_added_pairs": len(other - today),
        "b_dropped_pairs": len(today - other),
        "b_kept_pairs_today": len(today),
        "b_density": result.index.density(batch),
        "b_rel_err": relative_l2_error(
            reference_sparse.sparse_attention(q, k, v, batch, result.index, plan=result.plan), dense
        ),
    }


def study(workload: str, seqlen: int, alpha: float, args: argparse.Namespace) -> dict[str, object]:
    """Errors of one (workload, length, alpha): no correction, today's correction and the two subtracted forms."""
    q, k, v, batch = study_inputs(workload, seqlen, args)
    dense = dense_attention(q, k, v, batch, compute_dtype=torch.float32)
    result = SparsePrefillPipeline(SelectionConfig(alpha=alpha), backend="reference")(q, k, v, batch)
    index, plan = result.index, result.plan
    uncorrected = reference_sparse.sparse_attention(q, k, v, batch, index)
    today = reference_sparse.sparse_attention(q, k, v, batch, index, plan=plan)
    record = record_header(workload, seqlen, alpha, args, index.density(batch))
    record["rel_err_uncorrected"] = relative_l2_error(uncorrected, dense)
    record["rel_err_today"] = relative_l2_error(today, dense)
    line = f"{workload} L={seqlen} alpha={alpha} density {record['density']:.3f}: "
    line += f"no corr {record['rel_err_uncorrected']:.4f}, today {record['rel_err_today']:.4f}"
    for name, kernel in (("exact", False), ("kernel", True)):
        out, tally = subtracted_attention(q, k, v, batch, index, plan.statistics, kernel)
        record[f"rel_err_{name}"] = relative_l2_error(out, dense)
        record[f"distance_to_today_{name}"] = relative_l2_error(out, today)
        record[f"clamped_rows_{name}"] = tally.clamped_rows
        record[f"max_rise_{name}"] = tally.max_rise
        line += f", {name} {record[f'rel_err_{name}']:.4f} (to today {record[f'distance_to_today_{name}']:.1e}"
        line += f", clamped {tally.clamped_rows}/{tally.rows}, rise {tally.max_rise:.2f})"
    record["kept_eligible_share"] = tally.kept_eligible / max(tally.eligible, 1)  # the same in both variants
    line += f"; kept share of eligible {record['kept_eligible_share']:.3f}"
    record.update(b_energies(q, k, v, batch, alpha, index, dense))
    line += f"; B energies: +{record['b_added_pairs']} -{record['b_dropped_pairs']} of {record['b_kept_pairs_today']}"
    line += f" kept pairs, error {record['b_rel_err']:.4f}"
    print(line, flush=True)
    if record["distance_to_today_exact"] > 1e-4:
        distance = record["distance_to_today_exact"]
        raise SystemExit(f"the exact decomposition differs from today's correction: {distance}")
    return record


def plot(records: list[dict[str, object]], path: Path) -> None:
    """Left: error against dense per grid point (no correction, today's, both subtracted forms). Right, log
    scale: the subtracted forms' distance to today's corrected output beside today's error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10, 3.2 * len(records)), 4.5))
    labels = [f"{r['workload']}\nL={r['L']}\nalpha={r['alpha']}" for r in records]
    errors = {
        "no correction": [r["rel_err_uncorrected"] for r in records],
        "today": [r["rel_err_today"] for r in records],
        "all minus kept, fp32": [r["rel_err_exact"] for r in records],
        "all minus kept, kernel numerics": [r["rel_err_kernel"] for r in records],
    }
    grouped_bars(left, errors, labels, "relative L2 error vs fp32 dense")
    distances = {
        "today's error vs dense": [r["rel_err_today"] for r in records],
        "fp32 form to today": [r["distance_to_today_exact"] for r in records],
        "kernel numerics to today": [r["distance_to_today_kernel"] for r in records],
    }
    grouped_bars(right, distances, labels, "relative L2 distance to today's corrected output")
    right.set_yscale("log")
    save_figure(fig, path)


def main() -> None:
    """Run the study for every (workload, length, alpha) and write the JSON and the plot under ``--out``."""
    parser = study_parser(__doc__, seqlen=8192, q_heads=8, kv_heads=2, out="subtracted-correction-study")
    run_grid(study, parser.parse_args(), "subtracted-correction-study", plot)


if __name__ == "__main__":
    main()
