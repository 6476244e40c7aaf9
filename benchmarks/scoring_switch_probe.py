"""The index's Hopper scoring kernel under the settings of one environment switch, interleaved in one process.

For each ``--shapes`` entry (``BxL``, planted, 32/8 heads, page 1; each ``--dtypes`` and ``--head-dims``, bf16 and
d = 128 by default) the keys are pooled once, then
``select_blocks_triton`` with the Hopper scoring runs under each setting of ``--env`` (the launcher reads it at
every launch): per setting the scoring kernel's GPU time (torch.profiler over ``--profiled`` calls), the select
call's time in rounds that alternate the settings (``--calls`` calls back to back between CUDA events a
sample), and the index compared pair by pair with the first setting's. Prints one JSON line per shape.

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``python benchmarks/scoring_switch_probe.py --env FPV2_SCORE_POLY_EXP --settings 0,2,3 --shapes 1x131072``;
without ``--env`` it times the library as built (one setting, ``built``), for A/Bs of libraries process by process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from functools import partial
from pathlib import Path

import torch
from attention_switch_probe import timed  # this folder, first on sys.path when run as a script

from fpv2.index.config import SelectionConfig
from fpv2.index.triton import IndexWorkspace, pool_blocks_triton, select_blocks_triton
from fpv2.index.triton.hopper_scoring import SCORING_ENV
from fpv2.kernel.testing import planted_workload


def scoring_kernel_us(call, calls: int) -> float:
    """GPU microseconds per call of the kernels whose name holds ``score_select`` (torch.profiler)."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    total = sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and "score_select" in e.key
    )
    return round(total / calls, 1)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _apply(env: str | None, setting: str) -> None:
    """Set the switch to ``setting`` (nothing to set without a switch)."""
    if env is not None:
        os.environ[env] = setting


def shape_row(
    batch: int, length: int, dtype: str, head_dim: int, env: str | None, settings: list[str], args: argparse.Namespace
) -> dict:
    """One shape: per setting the kernel's time, the select call's medians, and the index against the first."""
    w = planted_workload([length] * batch, num_q_heads=32, num_kv_heads=8, head_dim=head_dim, page_size=1,
                         dtype=DTYPES[dtype], device=torch.device("cuda"))  # fmt: skip
    config = SelectionConfig(alpha=args.alpha)
    stats = pool_blocks_triton(w.k_cache, None, w.batch, query_dtype=w.q.dtype)
    call = partial(select_blocks_triton, w.q, w.batch, stats, config=config, workspace=IndexWorkspace())
    num_blocks = -(-length // config.block_size)
    masks, kernels = {}, {}
    for setting in settings:
        _apply(env, setting)
        timed(call, 2)  # warm-up
        index = select_blocks_triton(w.q, w.batch, stats, config=config, exact_nnz=True)
        masks[setting] = index.to_dense_mask(num_blocks)
        kernels[setting] = scoring_kernel_us(call, args.profiled)
    samples: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for setting in settings if r % 2 == 0 else settings[::-1]:
            _apply(env, setting)
            samples[setting].append(timed(call, args.calls))
    first = masks[settings[0]]
    return {
        "label": args.label,
        "env": env,
        "B": batch,
        "L": length,
        "dtype": dtype,
        "d": head_dim,
        "alpha": args.alpha,
        "gpu": torch.cuda.get_device_name(),
        "scoring_kernel_us": kernels,
        "select_median_ms": {s: round(statistics.median(v), 4) for s, v in samples.items()},
        "select_min_ms": {s: round(min(v), 4) for s, v in samples.items()},
        "differing_pairs": {s: int((masks[s] ^ first).sum()) for s in settings},
        "kept_pairs": int(first.sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", help="the environment switch, e.g. FPV2_SCORE_POLY_EXP (none: the library as built)")
    parser.add_argument("--settings", help="its values, comma-separated; the first is the baseline")
    parser.add_argument("--shapes", nargs="+", default=["1x32768", "1x131072", "4x131072"], help="BxL entries")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"], help="element types")
    parser.add_argument("--head-dims", nargs="+", type=int, choices=(64, 128), default=[128], help="head dims")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=3, help="calls per timed sample")
    parser.add_argument("--profiled", type=int, default=5, help="calls averaged for the kernel's own time")
    parser.add_argument("--label", default="", help="a name for the library under test, copied into the JSON")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file to append the rows to")
    args = parser.parse_args()
    if (args.env is None) != (args.settings is None):
        parser.error("--env and --settings go together")
    if not torch.cuda.is_available():
        raise SystemExit("scoring_switch_probe needs a CUDA GPU (the Hopper scoring kernel)")
    os.environ[SCORING_ENV] = "hopper"
    previous = os.environ.get(args.env) if args.env is not None else None
    settings = args.settings.split(",") if args.env is not None else ["built"]
    for dtype, head_dim, shape in itertools.product(args.dtypes, args.head_dims, args.shapes):
        batch, length = (int(x) for x in shape.split("x"))
        row = shape_row(batch, length, dtype, head_dim, args.env, settings, args)
        print(json.dumps(row), flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()
    if args.env is None:
        return
    if previous is None:  # the launcher reads the switch at every launch: put back what the caller had
        os.environ.pop(args.env, None)
    else:
        os.environ[args.env] = previous


if __name__ == "__main__":
    main()
