"""The Hopper backend's tile repack on a side stream under the index stage, against the copy in front of the kernel.

Part 1 (``--lengths``, ``--batches``): the planted corrected pipeline at page size 1 on the Hopper backend with
``HopperBackend.overlap_repack`` on and off, alternating (on, off, off, on); eager and host-ahead GPU medians.
Part 2 (``--vllm-lengths``): vLLM 0.33's K/V views (one ``(num_blocks, Hkv, 16, 2 d)`` buffer, head stride
``2 d``) at block size 16, which the kernel reads only through the copy: the Triton backend (where ``auto``
sent them before) against copy + Hopper, alternating; eager and host-ahead medians and the relative difference
of the two outputs.

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``python benchmarks/repack_overlap_speed.py --lengths 32768 131072 --batches 1 4 --vllm-lengths 32768 131072
--out overlap.json``
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from fpv2.kernel.testing import planted_workload
from fpv2.serving import SparsePrefillPipeline
from fpv2.serving.adapters.vllm_kv_cache import kv_cache_views
from fpv2.serving.backends import HopperBackend, resolve_backend
from fpv2.serving.timing import host_ahead_samples, median, timed_samples

ALTERNATION = (True, False, False, True)


def _time(call, repeats: int, device: torch.device) -> tuple[float, float | None]:
    eager, _ = timed_samples(call, 2, repeats, device)
    ahead, _ = host_ahead_samples(call, repeats, device)
    return median(eager), (median(ahead) if ahead else None)


def overlap_rows(lengths: list[int], batches: list[int], repeats: int, device: torch.device) -> list[dict]:
    """Part 1: side-stream copy against the copy in :meth:`HopperBackend.run`."""
    rows = []
    for batch_size in batches:
        for length in lengths:
            wl = planted_workload(
                [length] * batch_size, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device
            )
            backend = HopperBackend()
            pipeline = SparsePrefillPipeline(backend=backend)
            runs: dict[bool, list[tuple[float, float | None]]] = {True: [], False: []}
            for overlap in ALTERNATION:
                backend.overlap_repack = overlap
                call = partial(pipeline, wl.q, wl.k_cache, wl.v_cache, wl.batch)
                runs[overlap].append(_time(call, repeats, device))
                assert backend.last_repack_stream == ("side-stream" if overlap else "inline")
            row = {
                "part": "overlap",
                "B": batch_size,
                "L": length,
                "page_size": 1,
                "side_stream_ms": [r[0] for r in runs[True]],
                "side_stream_gpu_ms": [r[1] for r in runs[True]],
                "inline_ms": [r[0] for r in runs[False]],
                "inline_gpu_ms": [r[1] for r in runs[False]],
                "gpu": torch.cuda.get_device_name(device),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return rows


def vllm_view_rows(lengths: list[int], repeats: int, device: torch.device) -> list[dict]:
    """Part 2: vLLM's K/V views at block size 16, Triton against copy + Hopper."""
    rows = []
    for length in lengths:
        wl = planted_workload([length], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, device=device)
        buffer = torch.cat([wl.k_cache, wl.v_cache], dim=-1).transpose(1, 2).contiguous()  # (blocks, Hkv, 16, 2d)
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
    parser.add_argument("--lengths", type=int, nargs="*", default=[32768, 131072])
    parser.add_argument("--batches", type=int, nargs="*", default=[1])
    parser.add_argument("--vllm-lengths", type=int, nargs="*", default=[])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    resolve_backend("triton")  # fail early if Triton is missing
    rows = overlap_rows(args.lengths, args.batches, args.repeats, device)
    rows += vllm_view_rows(args.vllm_lengths, args.repeats, device)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
