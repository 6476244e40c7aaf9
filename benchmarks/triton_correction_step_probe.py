"""The Triton kernel's mean-correction step under several launch settings, interleaved in one process.

Builds the planted workload, runs the pipeline once on the Triton backend (max_threshold, alpha 0.1, mean
correction) and keeps its block index and pooled statistics; the todo words are built once, so only the attention
kernel is timed. Then it replays the kernel alone: per sample ``--calls`` launches back to back between two CUDA
events (the host issues ahead, so the GPU time is the kernel's), the variants alternating within each round (the
order reversed every other round). The uncorrected kernel (the tuning table's ``sparse`` entry) runs in the same
rounds, so every variant's correction overhead is read against the same baseline.

A variant is a launch configuration (:class:`fpv2.kernel.triton.LaunchConfig`: the pooled vectors per correction
step and its pipelining depth) and optional environment switches the launcher reads at every call. Each variant's
output is compared with the tuning table's corrected output (largest absolute difference) and, for the first
length, with the kernel's own dense mode (relative L2 error, the bench's accuracy measure).

Usage (the four packages' ``src`` on ``PYTHONPATH``, a CUDA GPU):
``python benchmarks/triton_correction_step_probe.py --seqlens 131072,32768 --out OUT.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from attention_switch_probe import apply_env, timed  # this folder, first on sys.path when run as a script

from fpv2.index import SelectionConfig
from fpv2.kernel import CorrectionPlan
from fpv2.kernel.testing import planted_workload
from fpv2.kernel.triton import LaunchConfig, launch_config, sparse_attention_triton
from fpv2.kernel.triton.todo_words import todo_words
from fpv2.serving.pipeline import SparsePrefillPipeline

SHAPE = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}

#: name -> (pooled vectors per correction step, correction pipelining depth, environment switches);
#: None for the step or depth keeps the tuning table's value. "sparse" is the uncorrected baseline. Kernel
#: changes are A/B'd by adding their temporary switch here (the 39th session's ``log2_bias`` and ``early_v``,
#: results/2026-12-06-h100-triton-correction-step/).
VARIANTS: dict[str, tuple[int | None, int | None, dict[str, str]]] = {
    "table": (None, None, {}),
    "stages2": (None, 2, {}),
    "stages3": (None, 3, {}),
    "step128": (128, 1, {}),
    "step128_stages2": (128, 2, {}),
    "step32_stages2": (32, 2, {}),
}
SWITCHES = sorted({name for _, _, env in VARIANTS.values() for name in env})


def relative_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in fp32."""
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def probe_length(seqlen: int, batch: int, args: argparse.Namespace, wanted: list[str]) -> dict:
    """Times every wanted variant and the uncorrected baseline at one length; returns the row."""
    device = torch.device("cuda")
    wl = planted_workload([seqlen] * batch, **SHAPE, page_size=args.page_size, dtype=torch.bfloat16, device=device,
                          seed=args.seed)  # fmt: skip
    pipe = SparsePrefillPipeline(SelectionConfig(alpha=args.alpha), correction=True, backend="triton")
    result = pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    index, stats = result.index, result.statistics
    offsets, words = todo_words(index, wl.batch)
    plan = CorrectionPlan(stats, offsets, words)
    table = launch_config(SHAPE["head_dim"], index.block_size, "correction")

    def call(name: str) -> Callable[[], torch.Tensor]:
        if name == "sparse":
            return lambda: sparse_attention_triton(wl.q, wl.k_cache, wl.v_cache, wl.batch, index)
        step, stages, _ = VARIANTS[name]
        launch = LaunchConfig(
            block_n=table.block_n,
            num_warps=table.num_warps,
            num_stages=table.num_stages,
            correction_step=step or table.correction_step,
            correction_stages=stages or table.correction_stages,
            reverse_grid=table.reverse_grid,
        )
        return lambda: sparse_attention_triton(wl.q, wl.k_cache, wl.v_cache, wl.batch, index, plan=plan, launch=launch)

    names = ["sparse", *wanted]
    launches = {name: call(name) for name in names}
    outputs = {}
    for name in names:  # compiles each variant, and keeps its output for the comparison
        apply_env(VARIANTS.get(name, (None, None, {}))[2], SWITCHES)
        outputs[name] = launches[name]().clone()
    torch.cuda.synchronize()
    dense = sparse_attention_triton(wl.q, wl.k_cache, wl.v_cache, wl.batch) if args.dense_error else None
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_number in range(args.rounds):
        for name in names if round_number % 2 == 0 else reversed(names):
            apply_env(VARIANTS.get(name, (None, None, {}))[2], SWITCHES)
            times[name].append(timed(launches[name], args.calls))
    apply_env({}, SWITCHES)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "seqlen": seqlen,
        "batch": batch,
        "page_size": args.page_size,
        "alpha": args.alpha,
        "density": round(index.density(wl.batch), 5),
        "gpu": torch.cuda.get_device_name(),
        "rounds": args.rounds,
        "calls": args.calls,
        "table": {"correction_step": table.correction_step, "correction_stages": table.correction_stages},
        "median_ms": {name: round(ms, 4) for name, ms in median.items()},
        "min_ms": {name: round(min(t), 4) for name, t in times.items()},
        "max_ms": {name: round(max(t), 4) for name, t in times.items()},
        "correction_overhead": {name: round(median[name] / median["sparse"] - 1, 4) for name in wanted},
        "change_vs_table": {name: round(median[name] / median["table"] - 1, 4) for name in wanted},
        "max_abs_difference_vs_table": {
            name: (outputs[name].float() - outputs["table"].float()).abs().max().item() for name in wanted
        },
        "rel_err_vs_dense": (
            {name: round(relative_l2(outputs[name], dense), 5) for name in names} if dense is not None else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="131072", help="comma-separated query lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=5, help="launches per timed sample")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    parser.add_argument("--dense-error", action="store_true", help="also the error vs the kernel's dense mode")
    parser.add_argument("--out", help="write the rows as a JSON list here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("triton_correction_step_probe needs a CUDA GPU")
    wanted = args.variants.split(",")
    unknown = [name for name in wanted if name not in VARIANTS]
    if unknown or "table" not in wanted:
        parser.error(f"--variants must name 'table' and only {list(VARIANTS)}; unknown: {unknown}")
    rows = []
    for seqlen in (int(n) for n in args.seqlens.split(",")):
        row = probe_length(seqlen, args.batch, args, wanted)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    for row in rows:
        print(f"\nB={row['batch']} L={row['seqlen']} ({row['gpu']}): uncorrected {row['median_ms']['sparse']:.3f} ms")
        for name in wanted:
            print(f"  {name:18s} {row['median_ms'][name]:8.3f} ms  overhead {row['correction_overhead'][name]:+.1%}"
                  f"  vs table {row['change_vs_table'][name]:+.1%}"
                  f"  max|diff| {row['max_abs_difference_vs_table'][name]:.2e}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
