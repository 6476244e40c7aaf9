"""The index's selection with the Hopper (wgmma) scoring kernel against the fused Triton pass.

For each ``--shapes`` entry (``BxL``: B requests of L tokens, no prefix), a planted bf16 workload (32/8 heads,
d = 128, page 1) is pooled once (with the scoring copy of the keys, as the pipeline pools), then
``select_blocks_triton`` (prepared keys, scoring and selection, compaction; no host sync) is timed with
``FPV2_INDEX_SCORING=triton`` and ``=hopper`` alternating (A, B, B, A), median of ``--repeats`` CUDA-event
samples each; the two indexes are compared pair by pair (kept (segment, block) pairs that differ: blocks within
rounding of ``alpha``). A torch.profiler pass gives each scoring kernel's own GPU time.

``--pipeline`` times the whole corrected pipeline instead (``SparsePrefillPipeline`` on the Hopper backend,
pooling, index, plan and attention; eager, each call on an idle GPU, as ``fpv2 bench`` times it), in the same
alternation, and compares the two outputs.

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``python benchmarks/hopper_scoring_speed.py --shapes 1x32768 1x131072 4x131072 --out hopper-scoring.json``
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import torch

from fpv2.index.config import SelectionConfig
from fpv2.index.triton import IndexWorkspace, pool_blocks_triton, select_blocks_triton
from fpv2.index.triton.hopper_scoring import SCORING_ENV
from fpv2.kernel.testing import planted_workload
from fpv2.serving.environment import git_commit, gpu_name
from fpv2.serving.pipeline import SparsePrefillPipeline
from fpv2.serving.timing import median, timed_samples

MODES = ("triton", "hopper")


def _kernel_times(call, device: torch.device) -> dict[str, float]:
    """GPU microseconds per kernel name of one call (torch.profiler, after a warm-up)."""
    call()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize(device)
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            times[event.key[:80]] = round(event.self_device_time_total, 1)
    return times


def row(batch: int, length: int, repeats: int, alpha: float, device: torch.device, profile: bool = True) -> dict:
    w = planted_workload([length] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device)
    config = SelectionConfig(alpha=alpha)
    stats = pool_blocks_triton(w.k_cache, None, w.batch, query_dtype=w.q.dtype)
    workspace = IndexWorkspace()
    call = partial(select_blocks_triton, w.q, w.batch, stats, config=config, workspace=workspace)
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    indexes = {}
    kernels = {}
    for mode in ("triton", "hopper", "hopper", "triton"):
        os.environ[SCORING_ENV] = mode
        samples, _ = timed_samples(call, 3, repeats, device)
        runs[mode].append(median(samples))
        indexes[mode] = select_blocks_triton(w.q, w.batch, stats, config=config, exact_nnz=True)
        if profile and mode not in kernels:
            kernels[mode] = _kernel_times(call, device)
    os.environ.pop(SCORING_ENV, None)
    nb = -(-length // config.block_size)
    a, b = (indexes[m].to_dense_mask(nb) for m in MODES)
    return {
        "B": batch,
        "L": length,
        "alpha": alpha,
        "select_ms": runs,
        "kernels_us": kernels,
        "kept_pairs": int(indexes["triton"].offsets[-1]),
        "differing_pairs": int((a ^ b).sum()),
        "density_triton": indexes["triton"].density(w.batch),
        "density_hopper": indexes["hopper"].density(w.batch),
    }


def pipeline_row(batch: int, length: int, repeats: int, alpha: float, device: torch.device) -> dict:
    """The corrected pipeline (Hopper backend, page 1) with each scoring pass, alternating: eager medians in ms."""
    w = planted_workload([length] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device)
    pipeline = SparsePrefillPipeline(SelectionConfig(alpha=alpha), backend="hopper")
    call = partial(pipeline, w.q, w.k_cache, w.v_cache, w.batch)
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    outputs = {}
    for mode in ("triton", "hopper", "hopper", "triton"):
        os.environ[SCORING_ENV] = mode
        samples, result = timed_samples(call, 3, repeats, device)
        runs[mode].append(median(samples))
        outputs[mode] = result.out
    os.environ.pop(SCORING_ENV, None)
    a, b = (outputs[m].float() for m in MODES)
    return {
        "B": batch,
        "L": length,
        "alpha": alpha,
        "pipeline_ms": runs,
        "output_relative_difference": float((a - b).norm() / a.norm()),
    }


def summary(result: dict) -> str:
    """One line per row: the select call's medians and each mode's kernel times (names cut to 40 characters)."""
    if "pipeline_ms" in result:
        return (
            f"{result['B']} x {result['L']}: pipeline {result['pipeline_ms']}, outputs differ by "
            f"{result['output_relative_difference']:.2e}"
        )
    kernels = {mode: {name[:40]: us for name, us in times.items()} for mode, times in result["kernels_us"].items()}
    return (
        f"{result['B']} x {result['L']}: select {result['select_ms']}, differing pairs {result['differing_pairs']}, "
        f"kernels {kernels}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x32768", "1x131072", "4x131072"], help="BxL entries")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-kernel-times", action="store_true", help="skip the torch.profiler pass (under ncu)")
    parser.add_argument("--pipeline", action="store_true", help="time the corrected pipeline, not the select call")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for shape in args.shapes:
        batch, length = (int(x) for x in shape.lower().split("x"))
        if args.pipeline:
            result = pipeline_row(batch, length, args.repeats, args.alpha, device)
        else:
            result = row(batch, length, args.repeats, args.alpha, device, profile=not args.no_kernel_times)
        result.update(gpu=gpu_name(device), commit=git_commit())
        rows.append(result)
        print(summary(result), flush=True)
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
