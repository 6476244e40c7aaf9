"""Short chunks after a long cached prefix: is the tile repack still worth it, for readable pages and for views?

For each ``--chunks`` size, a planted request with that many queries at the end of ``--seqlen`` keys runs through
the corrected pipeline, alternating (A, B, B, A), median eager milliseconds of ``--repeats`` calls each:

- ``page1``: page size 1, the Hopper backend with the copy forced (``FPV2_HOPPER_REPACK=1``) against its cp.async
  gather (``=0``): where ``tile_repack_policy.MIN_QUERY_SHARE`` should be for caches the kernel reads itself;
- ``vllm``: vLLM 0.33's K/V views at block size 16 (head-major order, head stride ``16 * 2 d``: only the copy
  reads them), the Hopper backend with the copy forced against the Triton backend (where such chunks go without
  the copy).

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``python benchmarks/short_chunk_copy.py --seqlen 131072 --chunks 512 1024 2048 4096 --out short-chunks.json``
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from pathlib import Path

import torch

from fpv2.kernel.testing import planted_workload
from fpv2.serving import SparsePrefillPipeline
from fpv2.serving.adapters.vllm_kv_cache import kv_cache_views, paged_as_kv_cache
from fpv2.serving.tile_repack_policy import REPACK_ENV
from fpv2.serving.timing import median, timed_samples


def _time(pipeline: SparsePrefillPipeline, args: tuple, repeats: int, device: torch.device) -> float:
    samples, _ = timed_samples(partial(pipeline, *args), 2, repeats, device)
    return median(samples)


def page1_row(chunk: int, seqlen: int, repeats: int, device: torch.device) -> dict:
    """Copy forced on and off at page size 1 (Hopper backend)."""
    wl = planted_workload([chunk], [seqlen], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device)
    pipeline = SparsePrefillPipeline(backend="hopper")
    runs: dict[str, list[float]] = {"1": [], "0": []}
    for mode in ("1", "0", "0", "1"):
        os.environ[REPACK_ENV] = mode
        runs[mode].append(_time(pipeline, (wl.q, wl.k_cache, wl.v_cache, wl.batch), repeats, device))
    os.environ.pop(REPACK_ENV, None)
    return {"layout": "page1", "copy_ms": runs["1"], "gather_ms": runs["0"]}


def vllm_row(chunk: int, seqlen: int, repeats: int, device: torch.device) -> dict:
    """vLLM's views at block size 16: copy + Hopper against the Triton backend."""
    wl = planted_workload([chunk], [seqlen], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, device=device)
    # The layout of the 2026-12-04 measurement: head-major inside a block (token stride 2d, head stride 16 x 2d).
    buffer = paged_as_kv_cache(wl.k_cache, wl.v_cache, "HND")
    k_view, v_view = kv_cache_views(buffer, 128)
    pipelines = {"copy": SparsePrefillPipeline(backend="hopper"), "triton": SparsePrefillPipeline(backend="triton")}
    runs: dict[str, list[float]] = {"copy": [], "triton": []}
    os.environ[REPACK_ENV] = "1"
    for name in ("copy", "triton", "triton", "copy"):
        runs[name].append(_time(pipelines[name], (wl.q, k_view, v_view, wl.batch), repeats, device))
    os.environ.pop(REPACK_ENV, None)
    return {"layout": "vllm16", "copy_ms": runs["copy"], "triton_ms": runs["triton"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072, help="KV length, the prefix included")
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--layouts", nargs="+", choices=("page1", "vllm"), default=["page1", "vllm"])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for chunk in args.chunks:
        for layout in args.layouts:
            measure = page1_row if layout == "page1" else vllm_row
            row = measure(chunk, args.seqlen, args.repeats, device)
            row.update(q_len=chunk, kv_len=args.seqlen, query_share=chunk / args.seqlen)
            row["gpu"] = torch.cuda.get_device_name(device)
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
