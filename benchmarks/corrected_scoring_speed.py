"""What carrying the mean correction in the scoring pass would cost: pass 1 with the pooled terms, measured.

For each ``--shapes`` entry (``BxL``, planted bf16 workload, 32/8 heads, d = 128, page 1), the pooled statistics
are made once as the pipeline makes them (prepared keys, bf16 pooled copies); then, each kernel's own GPU time
from torch.profiler (median over ``--repeats`` profiled calls):

* ``corrected``: :func:`fpv2.index.triton.corrected_scoring.score_with_correction` (energies and the eligible
  pooled terms of every row);
* ``energies_only``: the same kernel without the pooled terms (the row-major orientation's own cost);
* ``terms_only``: without the energies (a plain online softmax over the eligible pooled keys: what a separate
  pooled-attention pass would cost), and launch-shape variants (:data:`VARIANTS`);
* ``select_triton`` / ``select_hopper``: the index's selection call with each scoring pass (its kernels);
* ``hopper_attention_corrected`` / ``_plain`` (and ``triton_...``): the pipeline's kernels with the Hopper and
  the Triton attention backends, with and without the correction: what the correction costs where it runs today.

A spot check compares the corrected pass with a float64 reference on a few tiles of request 0 (head 0).

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``python benchmarks/corrected_scoring_speed.py --shapes 1x32768 1x131072 4x131072 --out corrected-scoring.json``
"""

from __future__ import annotations

import math
import os
from functools import partial

import torch
from shape_rows import kernel_lines, kernel_times, shape_main

from fpv2.index.config import SelectionConfig
from fpv2.index.triton import pool_blocks_triton, select_blocks_triton
from fpv2.index.triton.corrected_scoring import TILE_ROWS, score_with_correction
from fpv2.index.triton.hopper_scoring import SCORING_ENV
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline

LOG2E = math.log2(math.e)
#: The pass's variants timed: both halves, each half alone, and the launch shape.
VARIANTS = {
    "corrected": {},
    "energies_only": {"accumulate": False},
    "terms_only": {"energies": False},
    "corrected_4_warps": {"num_warps": 4},
    "corrected_block_n_32": {"block_n": 32},
    "terms_only_3_stages": {"energies": False, "num_stages": 3},
}


def spot_check(args: dict, got, group: int, tiles: list[int]) -> dict[str, float]:
    """Largest errors of ``got`` against float64 on ``tiles`` of request 0, KV head 0."""
    q_len = int(args["cu_seqlens_q"][1])
    prefix = int(args["seqlens_k"][0]) - q_len
    nb = int(args["block_offsets"][1])
    bk = args["block_size"]
    keys = args["keys"][:nb, 0].double()
    values = args["values"][:nb, 0].double()
    lengths = args["block_lengths"][:nb].double()
    worst = {"energy_vs_peak": 0.0, "lse": 0.0, "out_relative": 0.0}
    for t in tiles:
        rows = torch.arange(t * TILE_ROWS, min((t + 1) * TILE_ROWS, q_len * group), device=keys.device)
        tokens, heads, pos = rows // group, rows % group, prefix + rows // group
        s = args["q"][tokens, heads].double() @ keys.T
        num_scored = (int(pos[-1]) + 1) // bk
        if num_scored == 0:
            continue
        ids = torch.arange(nb, device=keys.device)
        visible = (ids[None, :] * bk <= pos[:, None]) & (ids[None, :] < num_scored)
        energy = torch.logsumexp(torch.where(visible, s, -math.inf) / LOG2E, dim=0)[:num_scored] * LOG2E
        peak = energy.max()
        got_energy = got.energies[0, 0, t, :num_scored].double()
        rel = ((got_energy - peak).clamp(min=-100) - (energy - peak).clamp(min=-100)).abs().max()
        worst["energy_vs_peak"] = max(worst["energy_vs_peak"], float(rel))
        ne = int(pos[0]) // bk
        if ne == 0:
            continue
        logits = s[:, :ne] + torch.log2(lengths[:ne])[None, :]
        lse = torch.logsumexp(logits / LOG2E, dim=1) * LOG2E
        out = torch.softmax(logits / LOG2E, dim=1) @ values[:ne]
        worst["lse"] = max(worst["lse"], float((got.lse[tokens, heads].double() - lse).abs().max()))
        diff = (got.out[tokens, heads].double() - out).norm() / out.norm()
        worst["out_relative"] = max(worst["out_relative"], float(diff))
    return worst


def row(batch: int, length: int, repeats: int, alpha: float, device: torch.device) -> dict:
    w = planted_workload([length] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device)
    stats = pool_blocks_triton(
        w.k_cache, w.v_cache, w.batch, query_dtype=w.q.dtype, pooled_copy_dtype=torch.bfloat16
    )  # fmt: skip
    args = dict(
        q=w.q,
        cu_seqlens_q=w.batch.cu_seqlens_q,
        seqlens_k=w.batch.seqlens_k,
        keys=stats.prepared_keys.keys,
        values=stats.pooled_copies.v,
        block_lengths=stats.block_lengths,
        block_offsets=stats.block_offsets,
        max_seqlen_q=length,
        max_seqlen_k=length,
        block_size=stats.block_size,
    )
    times = {
        name: kernel_times(partial(score_with_correction, **args, **options), device, repeats)
        for name, options in VARIANTS.items()
    }
    config = SelectionConfig(alpha=alpha)
    for mode in ("triton", "hopper"):
        os.environ[SCORING_ENV] = mode
        times[f"select_{mode}"] = kernel_times(
            lambda: select_blocks_triton(w.q, w.batch, stats, config=config), device, repeats
        )
    os.environ.pop(SCORING_ENV, None)
    for backend in ("hopper", "triton"):
        for name, correction in (("corrected", True), ("plain", False)):
            pipeline = SparsePrefillPipeline(config, backend=backend, correction=correction)
            call = partial(pipeline, w.q, w.k_cache, w.v_cache, w.batch)
            times[f"{backend}_attention_{name}"] = kernel_times(call, device, max(3, repeats // 3))
    got = score_with_correction(**args)
    tiles_per_head = -(-length * 4 // TILE_ROWS)
    check = spot_check(args, got, group=4, tiles=[0, 1, tiles_per_head // 2, tiles_per_head - 1])
    return {"B": batch, "L": length, "alpha": alpha, "kernels_us": times, "spot_check_max_errors": check}


def summary(result: dict) -> str:
    lines = [f"{result['B']} x {result['L']}: spot check {result['spot_check_max_errors']}"]
    lines += kernel_lines(result["kernels_us"], top=3, width=48)
    return "\n".join(lines)


def main() -> None:
    shape_main(__doc__.split("\n")[0], row, summary)


if __name__ == "__main__":
    main()
