"""Shared pieces of the per-shape device benchmarks: per-kernel GPU times and the ``BxL`` row loop."""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from fpv2.serving.environment import git_commit, gpu_name


def kernel_times(call: Callable[[], object], device: torch.device, repeats: int = 3) -> dict[str, float]:
    """Median GPU microseconds per kernel name (first 80 characters) over ``repeats`` profiled calls.

    One warm-up call runs first; kernels seen fewer than ``repeats`` times (one-off launches) are left out.
    """
    call()
    torch.cuda.synchronize(device)
    samples: dict[str, list[float]] = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            call()
        torch.cuda.synchronize(device)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            samples.setdefault(event.name[:80], []).append(event.device_time_total)
    return {name: round(statistics.median(v), 1) for name, v in samples.items() if len(v) >= repeats}


def run_shapes(
    shapes: list[str], row: Callable[[int, int], dict], summary: Callable[[dict], str], out: Path
) -> list[dict]:
    """``row(B, L)`` for each ``BxL`` entry, stamped with the GPU and commit, printed, and all written to ``out``."""
    device = torch.device("cuda")
    rows = []
    for shape in shapes:
        batch, length = (int(x) for x in shape.lower().split("x"))
        result = row(batch, length)
        result.update(gpu=gpu_name(device), commit=git_commit())
        rows.append(result)
        print(summary(result), flush=True)
        torch.cuda.empty_cache()
    out.write_text(json.dumps(rows, indent=1))
    return rows


def shape_arguments(description: str) -> argparse.Namespace:
    """The per-shape scripts' command line: ``--shapes BxL ...``, ``--alpha``, ``--repeats``, ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shapes", nargs="+", default=["1x32768", "1x131072", "4x131072"], help="BxL entries")
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def kernel_lines(kernels_by_call: dict[str, dict[str, float]], top: int, width: int) -> list[str]:
    """One line per call: its ``top`` slowest kernels (names cut to ``width`` characters) and their microseconds."""
    lines = []
    for call, kernels in kernels_by_call.items():
        slowest = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"  {call}: " + ", ".join(f"{name[:width]} {us} us" for name, us in slowest))
    return lines


def shape_main(
    description: str, row: Callable[[int, int, int, float, torch.device], dict], summary: Callable[[dict], str]
) -> None:
    """A per-shape script's ``main``: :func:`shape_arguments`, then ``row(B, L, repeats, alpha, device)`` per shape."""
    args = shape_arguments(description)
    device = torch.device("cuda")
    run_shapes(args.shapes, lambda b, n: row(b, n, args.repeats, args.alpha, device), summary, args.out)
