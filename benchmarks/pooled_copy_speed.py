"""The tile-page copy made by the pooling kernel against the Hopper backend's own copy launch (page 1).

For each ``--shapes`` entry (``BxL``, planted bf16 workload, 32/8 heads, d = 128, page 1) the corrected pipeline
(Hopper backend) runs with the copy from the pooling kernel (``pooled``: the landed path) and with the backend's
own copy launch (``own``: ``tile_copies_for`` turned off on that pipeline's backend), alternating (A B B A):
eager and host-ahead medians of ``--repeats`` calls each, the kernels' GPU times from torch.profiler, and
whether the outputs are bit-identical (they must be: the same tile pages).

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``python benchmarks/pooled_copy_speed.py --shapes 1x32768 1x131072 4x131072 --out pooled-copy.json``
"""

from __future__ import annotations

from functools import partial

import torch
from shape_rows import kernel_lines, kernel_times, shape_main

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.backends import HopperBackend
from fpv2.serving.pipeline import SparsePrefillPipeline
from fpv2.serving.timing import host_ahead_samples, median, timed_samples

MODES = ("pooled", "own")


def row(batch: int, length: int, repeats: int, alpha: float, device: torch.device) -> dict:
    w = planted_workload([length] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device)
    # Two backend instances (the registry's "hopper" is one shared instance): the second launches its own copy.
    own = HopperBackend()
    own.tile_copies_for = lambda *args: None
    pipelines = {
        "pooled": SparsePrefillPipeline(SelectionConfig(alpha=alpha), backend="hopper"),
        "own": SparsePrefillPipeline(SelectionConfig(alpha=alpha), backend=own),
    }
    eager: dict[str, list[float]] = {m: [] for m in MODES}
    ahead: dict[str, list[float | None]] = {m: [] for m in MODES}
    outputs = {}
    for mode in ("pooled", "own", "own", "pooled"):
        call = partial(pipelines[mode], w.q, w.k_cache, w.v_cache, w.batch)
        samples, result = timed_samples(call, 3, repeats, device)
        eager[mode].append(round(median(samples), 3))
        gpu, _ = host_ahead_samples(call, repeats, device)
        ahead[mode].append(round(median(gpu), 3) if gpu else None)
        outputs[mode] = result.out
        assert pipelines[mode].backend.last_copy_pooled is (mode == "pooled")
    calls = {mode: partial(pipelines[mode], w.q, w.k_cache, w.v_cache, w.batch) for mode in MODES}
    kernels = {mode: kernel_times(call, device) for mode, call in calls.items()}
    return {
        "B": batch,
        "L": length,
        "alpha": alpha,
        "eager_ms": eager,
        "host_ahead_ms": ahead,
        "kernels_us": kernels,
        "outputs_identical": bool(torch.equal(outputs["pooled"], outputs["own"])),
    }


def summary(result: dict) -> str:
    lines = [
        f"{result['B']} x {result['L']}: eager {result['eager_ms']}, host-ahead {result['host_ahead_ms']}, "
        f"identical {result['outputs_identical']}"
    ]
    lines += kernel_lines(result["kernels_us"], top=5, width=36)
    return "\n".join(lines)


def main() -> None:
    shape_main(__doc__.split("\n")[0], row, summary)


if __name__ == "__main__":
    main()
