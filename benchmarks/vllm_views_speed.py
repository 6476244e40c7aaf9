"""vLLM's K/V views on the Hopper kernel through the tile repack, against the Triton kernel that served them before.

vLLM 0.33 keeps one ``(num_blocks, Hkv, block_size, 2 d)`` buffer per layer and reads it as two strided views
(here its head-major order: token stride ``2 d``, head stride ``block_size * 2 d``), which the Hopper kernel cannot
read as rows; the tile repack reads any strides. For each
``--lengths`` entry, the planted corrected pipeline at block size 16 runs on such views with the Triton backend
and with copy + Hopper, alternating (Hopper, Triton, Triton, Hopper); prints and writes the eager and host-ahead
GPU medians of each and the relative difference of the two outputs.

(The 2026-12-04 measurement ran this part from ``repack_overlap_speed.py`` of commit f4f94b3, which also timed
the copy on a side stream: not kept, see ``benchmarks/NOTES.md``.)

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``python benchmarks/vllm_views_speed.py --lengths 32768 131072 --out vllm-views.json``
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from fpv2.kernel.testing import planted_workload
from fpv2.serving import SparsePrefillPipeline
from fpv2.serving.adapters.vllm_kv_cache import kv_cache_views, paged_as_kv_cache
from fpv2.serving.backends import HopperBackend, resolve_backend
from fpv2.serving.timing import host_ahead_samples, median, timed_samples

ALTERNATION = (True, False, False, True)


def _time(call, repeats: int, device: torch.device) -> tuple[float, float | None]:
    eager, _ = timed_samples(call, 2, repeats, device)
    ahead, _ = host_ahead_samples(call, repeats, device)
    return median(eager), (median(ahead) if ahead else None)


def vllm_view_rows(lengths: list[int], repeats: int, device: torch.device) -> list[dict]:
    """vLLM's K/V views at block size 16, Triton against copy + Hopper."""
    rows = []
    for length in lengths:
        wl = planted_workload([length], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, device=device)
        # The layout of the 2026-12-04 measurement: head-major inside a block (token stride 2d, head stride 16 x 2d).
        buffer = paged_as_kv_cache(wl.k_cache, wl.v_cache, "HND")
        k_view, v_view = kv_cache_views(buffer, 128)
        hopper = HopperBackend()
        pipelines = {"hopper": SparsePrefillPipeline(backend=hopper), "triton": SparsePrefillPipeline(backend="triton")}
        assert hopper.serves(wl.q, k_view, wl.batch, None) is None
        runs: dict[str, list[tuple[float, float | None]]] = {"hopper": [], "triton": []}
        outs = {}
        for first in ALTERNATION:
            name = "hopper" if first else "triton"
            pipeline = pipelines[name]
            runs[name].append(_time(partial(pipeline, wl.q, k_view, v_view, wl.batch), repeats, device))
            outs[name] = pipeline(wl.q, k_view, v_view, wl.batch).out.float()
        assert hopper.last_kv_layout == "tile-repack"
        diff = ((outs["hopper"] - outs["triton"]).norm() / outs["triton"].norm()).item()
        row = {
            "part": "vllm-views",
            "B": 1,
            "L": length,
            "page_size": 16,
            "k_strides": list(k_view.stride()),
            "hopper_copy_ms": [r[0] for r in runs["hopper"]],
            "hopper_copy_gpu_ms": [r[1] for r in runs["hopper"]],
            "triton_ms": [r[0] for r in runs["triton"]],
            "triton_gpu_ms": [r[1] for r in runs["triton"]],
            "rel_diff_hopper_vs_triton": diff,
            "gpu": torch.cuda.get_device_name(device),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    resolve_backend("triton")  # fail early if Triton is missing
    rows = vllm_view_rows(args.lengths, args.repeats, device)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
