"""Could the scoring pass carry the mean correction? The numerics of a fused correction, on the reference.

The index's scoring pass computes every pooled logit ``q_r . kbar_J`` that the correction needs again inside
the attention kernel (22-25% more steps there at 3-4% density: the correction overhead's floor,
``benchmarks/NOTES.md``). A fused design would, per tile, accumulate in the scoring pass

    l_r = sum_J |B_J| exp(s_rJ - M),   O_r = sum_J |B_J| exp(s_rJ - M) vbar_J

over *every* eligible block J (the pass does not know yet which blocks it keeps), with one tile-wide offset
``M`` (the pass keeps a tile maximum, not a row maximum), then subtract the terms of the kept eligible blocks
(a short step once the selection is known) and hand ``(M, l, O)`` to the attention kernel, which starts its
online softmax from them instead of running the pooled steps. Two things could go wrong numerically:

- cancellation: ``l`` and ``O`` are differences of sums; the kernel's P V product rounds P to bf16;
- the tile-wide offset: a row whose pooled logits all lie far below the tile's maximum underflows to zero
  and silently loses its correction.

For each ``--seqlen`` and ``--alpha`` this study runs the CPU reference pipeline on the planted workload,
rebuilds the corrected output the fused way (fp32, and with P rounded to bf16 before both products), and
prints the relative L2 difference from the reference's corrected output, the error of each against fp32
dense attention, and how many rows lost their pooled terms to the offset. Writes
``fused-correction-study.json``. CPU only.

Usage (the four packages' ``src`` on ``PYTHONPATH``):
``python benchmarks/fused_correction_study.py --seqlen 4096 8192 --alpha 0.05 0.1 0.2 --out OUT``
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.contracts import tile_span, validate_prefill_inputs
from fpv2.kernel.reference.attention import dense_attention, request_operands
from fpv2.kernel.reference.packgqa import pack_queries, packed_rows_to_position_head
from fpv2.kernel.reference.sparse import sparse_attention, tile_token_mask
from fpv2.kernel.testing import planted_workload
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.pipeline import SparsePrefillPipeline


def fused_corrected(wl, result, p_dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """The corrected output rebuilt the fused way; returns ``(out, rows, rows whose pooled terms underflowed)``.

    ``p_dtype``: the dtype P is rounded to before the two products (float32: none).
    """
    q, k_cache, v_cache, batch = wl.q, wl.k_cache, wl.v_cache, wl.batch
    shapes = validate_prefill_inputs(q, k_cache, v_cache, batch)
    index, stats = result.index, result.statistics
    scale = 1.0 / math.sqrt(shapes.head_dim)
    group, host = shapes.group, batch.host
    tile_offsets, offsets = index.tile_offsets.tolist(), index.offsets.tolist()
    blocks = index.blocks.tolist()
    block_offsets = stats.block_offsets.tolist()
    out = torch.zeros(q.shape[0], shapes.num_q_heads, shapes.head_dim, dtype=torch.float32)
    rows_total = rows_lost = 0
    for b in range(batch.num_requests):
        q_len, prefix, kv_len, start = host.q_lens[b], host.prefix[b], host.seqlens_k[b], host.cu_seqlens_q[b]
        q_b, k_b, v_b = request_operands(q, k_cache, v_cache, batch, b, shapes, torch.float32)
        ntiles = tile_offsets[b + 1] - tile_offsets[b]
        for h in range(shapes.num_kv_heads):
            packed = pack_queries(q_b, group, h)
            for t in range(ntiles):
                s = index.num_kv_heads * tile_offsets[b] + h * ntiles + t
                span = tile_span(t, q_len, prefix, group, tile_size=index.tile_size, block_size=index.block_size)
                rows = packed[span.row_begin : span.row_end]
                kept = blocks[offsets[s] : offsets[s + 1]]
                # Exact part: the kept tokens, one softmax state per row (row maximum m).
                tokens, allowed = tile_token_mask(torch.tensor(kept, dtype=torch.int32), span, kv_len, group)
                logits = ((rows @ k_b[tokens, h].T) * scale).masked_fill(~allowed, -math.inf)
                m = logits.amax(dim=1, keepdim=True)
                p = torch.exp(logits - m)
                l_exact, o_exact = p.sum(1, keepdim=True), p @ v_b[tokens, h]
                eligible = span.num_correctable_blocks
                rows_total += rows.shape[0]
                if eligible:
                    # The scoring pass's part: every eligible block, one tile-wide offset M.
                    base = block_offsets[b]
                    kbar = stats.pooled_k[base : base + eligible, h].float()
                    vbar = stats.pooled_v[base : base + eligible, h].float()
                    shift = torch.log(stats.block_lengths[base : base + eligible].float())
                    pooled = (rows @ kbar.T) * scale + shift[None, :]
                    big_m = pooled.max()
                    weights = torch.exp(pooled - big_m)
                    rows_lost += int((weights.amax(dim=1) == 0).sum())
                    # Then the kept eligible blocks' terms come off (their weights recomputed the same way).
                    kept_eligible = [j for j in kept if j < eligible]
                    rounded = weights.to(p_dtype).float()
                    l_pool = weights.sum(1, keepdim=True) - weights[:, kept_eligible].sum(1, keepdim=True)
                    o_pool = rounded @ vbar - rounded[:, kept_eligible] @ vbar[kept_eligible]
                    # Merge the two softmax states.
                    top = torch.maximum(m, big_m.expand_as(m))
                    a, c = torch.exp(m - top), torch.exp(big_m - top)
                    tile_out = (o_exact * a + o_pool * c) / (l_exact * a + l_pool * c)
                else:
                    tile_out = o_exact / l_exact
                positions, heads = packed_rows_to_position_head(torch.arange(span.row_begin, span.row_end), group, h)
                out[start + positions, heads] = tile_out
    return out, rows_total, rows_lost


def study(seqlen: int, alpha: float, seed: int) -> dict[str, object]:
    wl = planted_workload([seqlen], num_q_heads=16, num_kv_heads=4, head_dim=64, page_size=16, seed=seed)
    config = SelectionConfig(alpha=alpha, min_sparse_kv_len=0)
    result = SparsePrefillPipeline(config, backend="reference")(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    dense = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    # The reference corrected attention in fp32 (the pipeline's own output is rounded to the inputs' dtype).
    reference = sparse_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch, result.index, plan=result.plan)
    row = {"L": seqlen, "alpha": alpha, "density": result.index.density(wl.batch)}
    row["error_reference_vs_dense"] = relative_l2_error(reference, dense)
    for name, dtype in (("fp32", torch.float32), ("bf16_p", torch.bfloat16)):
        fused, rows, lost = fused_corrected(wl, result, dtype)
        row[f"fused_{name}_vs_reference"] = relative_l2_error(fused, reference)
        row[f"error_fused_{name}_vs_dense"] = relative_l2_error(fused, dense)
        row["rows"], row["rows_underflowed"] = rows, lost
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("fpv2-results/fused-correction-study"))
    args = parser.parse_args()
    rows = []
    for seqlen in args.seqlen:
        for alpha in args.alpha:
            row = study(seqlen, alpha, args.seed)
            rows.append(row)
            shown = {k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in row.items()}
            print(json.dumps(shown), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fused-correction-study.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
