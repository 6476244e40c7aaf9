"""What FP8 pooled products would cost in accuracy: the mean correction's terms rounded to e4m3.

The correction's pooled tiles are ~27% of the Hopper kernel's kept tiles at 128K (method floor,
``benchmarks/NOTES.md``); e4m3 wgmma runs them at twice the bf16 rate. Before writing that
kernel path, this study measures on the PyTorch reference what rounding only the correction's
operands to e4m3 does to the output error, with the scales such a kernel can apply cheaply:

- queries: one scale per packed row (a row factor on the pooled scores);
- pooled keys: one scale per (block, KV head) (a column factor, folded into the shift table);
- pooled values: one scale per (request, KV head, feature) (O divided before the pooled tiles and
  multiplied after, both per column);
- probabilities of the pooled columns: ``x 2**8`` onto e4m3 (as the Triton FP8 path does), the row
  sums from the unrounded values.

Kept blocks stay exact (fp32 here). For each ``--seqlen`` and ``--alpha`` it prints the relative L2
error against fp32 dense attention without correction, with the exact correction and with the e4m3
correction, on the planted workload (``fpv2 bench``'s), and writes ``fp8-correction-study.json``.
CPU-only (the reference); a 16K request with 16/4 heads takes about a minute per alpha.

Usage (the four packages' ``src`` on ``PYTHONPATH``):
``python benchmarks/fp8_correction_study.py --seqlen 16384 --alpha 0.05 0.1 0.2 --out OUT``
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from unittest import mock

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.reference import attention as reference_attention
from fpv2.kernel.reference import sparse as reference_sparse
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.reference.fp8 import FP8_E4M3_MAX, quantize_probabilities
from fpv2.kernel.testing import planted_workload
from fpv2.serving.metrics import relative_l2_error
from fpv2.serving.pipeline import SparsePrefillPipeline


def fake_e4m3(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 under the scale ``amax / 448`` (broadcast), back in x's dtype."""
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    return ((x / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)) * scale


class E4m3Correction:
    """Patches of the reference's pseudo-key and softmax steps that round the correction's operands."""

    def __init__(self, value_amax: torch.Tensor) -> None:
        self.value_amax = value_amax  # (total_blocks, Hkv, d) -> per (request, head, feature) amax rows
        self.pseudo_columns = 0
        self._masked_softmax = reference_attention.masked_softmax

    def pseudo_keys(self, rows, stats, stat_rows, kv_head, scale):
        """Pooled logits from e4m3 rows and keys, and e4m3 values (the exact function otherwise)."""
        idx = torch.tensor(stat_rows, dtype=torch.long)
        q8 = fake_e4m3(rows, rows.abs().amax(dim=1, keepdim=True))
        pooled_k = stats.pooled_k[idx, kv_head].to(rows.dtype)
        k8 = fake_e4m3(pooled_k, pooled_k.abs().amax(dim=1, keepdim=True))
        pooled_v = stats.pooled_v[idx, kv_head].to(rows.dtype)
        v8 = fake_e4m3(pooled_v, self.value_amax[idx, kv_head].to(rows.dtype))
        log_len = torch.log(stats.block_lengths[idx].to(rows.dtype))
        self.pseudo_columns = len(stat_rows)
        return (q8 @ k8.T) * scale + log_len[None, :], v8

    def masked_softmax(self, logits, values):
        """The reference softmax with the last ``pseudo_columns`` probabilities rounded to e4m3 for PV."""
        n = self.pseudo_columns
        self.pseudo_columns = 0
        if n == 0:
            return self._masked_softmax(logits, values)
        row_max = logits.amax(dim=1, keepdim=True)
        shift = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
        probs = torch.exp(logits - shift)
        denom = probs.sum(dim=1, keepdim=True)  # row sums from the unrounded probabilities
        rounded = torch.cat([probs[:, :-n], quantize_probabilities(probs[:, -n:])], dim=1)
        out = (rounded @ values) / torch.where(denom > 0, denom, torch.ones_like(denom))
        return out, (shift + torch.log(denom)).squeeze(1)


def value_amax_rows(stats) -> torch.Tensor:
    """Per (request, KV head, feature) amax of the pooled values, repeated onto each block's row."""
    pooled_v = stats.pooled_v.abs()
    offsets = stats.block_offsets.tolist()
    out = torch.empty_like(pooled_v)
    for begin, end in itertools.pairwise(offsets):
        if end > begin:
            out[begin:end] = pooled_v[begin:end].amax(dim=0, keepdim=True)
    return out


def study(seqlen: int, alpha: float, args: argparse.Namespace) -> dict[str, object]:
    """Errors of one (length, alpha): no correction, exact correction, e4m3 correction."""
    wl = planted_workload(
        [seqlen],
        num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=args.page_size,
        dtype=torch.bfloat16,
        seed=args.seed,
    )
    q, k, v = wl.q.float(), wl.k_cache.float(), wl.v_cache.float()
    dense = dense_attention(q, k, v, wl.batch, compute_dtype=torch.float32)
    result = SparsePrefillPipeline(SelectionConfig(alpha=alpha), backend="reference")(q, k, v, wl.batch)
    index, plan = result.index, result.plan
    exact = reference_sparse.sparse_attention(q, k, v, wl.batch, index, plan=plan)
    uncorrected = reference_sparse.sparse_attention(q, k, v, wl.batch, index)
    patch = E4m3Correction(value_amax_rows(plan.statistics))
    with (
        mock.patch.object(reference_sparse, "_pseudo_keys", patch.pseudo_keys),
        mock.patch.object(reference_sparse, "masked_softmax", patch.masked_softmax),
    ):
        e4m3 = reference_sparse.sparse_attention(q, k, v, wl.batch, index, plan=plan)
    record = {
        "L": seqlen,
        "alpha": alpha,
        "Hq": args.q_heads,
        "Hkv": args.kv_heads,
        "d": args.head_dim,
        "density": index.density(wl.batch),
        "rel_err_uncorrected": relative_l2_error(uncorrected, dense),
        "rel_err_corrected_exact": relative_l2_error(exact, dense),
        "rel_err_corrected_e4m3": relative_l2_error(e4m3, dense),
        "rel_diff_e4m3_vs_exact": relative_l2_error(e4m3, exact),
    }
    print(
        f"L={seqlen} alpha={alpha}: rel err vs dense: no corr {record['rel_err_uncorrected']:.4f}, "
        f"exact corr {record['rel_err_corrected_exact']:.4f}, e4m3 corr {record['rel_err_corrected_e4m3']:.4f} "
        f"(e4m3 vs exact {record['rel_diff_e4m3_vs_exact']:.4f})",
        flush=True,
    )
    return record


def main() -> None:
    """Run the study for every (length, alpha) and write the JSON under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, nargs="+", default=[16384])
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("fpv2-results/fp8-correction-study"))
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    records = [study(seqlen, alpha, args) for seqlen in args.seqlen for alpha in args.alpha]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8-correction-study.json").write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
