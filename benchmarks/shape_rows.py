"""Shared pieces of the per-shape device benchmarks: per-kernel GPU times and the ``BxL`` row loop."""

from __future__ import annotations

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
