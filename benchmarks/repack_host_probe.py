"""Host time of the Hopper backend's tile-repack path on an idle GPU, piece by piece (32K, page 1, 32/8 heads, d 128).

Prints the median host microseconds of: the policy's decision (``should_repack`` with the memory check) and its
two device queries (``torch.cuda.mem_get_info``, the allocator's counters); ``repack_to_tile_pages`` (validation,
allocation, the Triton launch, the tile batch), also with every launch through ``JITFunction.run``; building a
``PagedPrefillBatch`` like the one it returns; the C-ABI batch struct of a new batch and of a batch seen before.
Each sample starts after a ``torch.cuda.synchronize``, as a pipeline call on an idle GPU does.

Usage (the packages' ``src`` on ``PYTHONPATH``, on a GPU): ``python benchmarks/repack_host_probe.py``
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel._native import structs
from fpv2.kernel.testing import planted_workload
from fpv2.kernel.triton.relaunch import RELAUNCH_ENV
from fpv2.kernel.triton.tile_repack import repack_to_tile_pages
from fpv2.serving.tile_repack_policy import repack_headroom_bytes, should_repack
from fpv2.serving.timing import idle_host_us as median_us


def _without_relaunch(measure: Callable[[], float]) -> float:
    """``measure()`` with every launch through ``JITFunction.run`` (the relauncher switched off)."""
    os.environ[RELAUNCH_ENV] = "0"
    try:
        return measure()
    finally:
        del os.environ[RELAUNCH_ENV]


def main() -> None:
    device = torch.device("cuda", 0)
    wl = planted_workload([32768], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device)
    _ = wl.batch.host
    packed = repack_to_tile_pages(wl.k_cache, wl.v_cache, wl.batch)  # compiles
    tile = packed.batch

    def new_tile_batch() -> PagedPrefillBatch:
        return PagedPrefillBatch(
            cu_seqlens_q=tile.cu_seqlens_q,
            seqlens_k=tile.seqlens_k,
            page_table=tile.page_table,
            page_size=128,
            num_pages=tile.num_pages,
            check_values=False,
        )

    rows = {
        "should_repack (policy, memory check)": median_us(lambda: should_repack(wl.batch, 128, k_cache=wl.k_cache)),
        "should_repack (policy, no memory check)": median_us(lambda: should_repack(wl.batch, 128)),
        "torch.cuda.mem_get_info": median_us(lambda: torch.cuda.mem_get_info(device)),
        "torch.cuda.memory_stats_as_nested_dict": median_us(lambda: torch.cuda.memory_stats_as_nested_dict(device)),
        "repack_headroom_bytes": median_us(lambda: repack_headroom_bytes(device)),
        "repack_to_tile_pages": median_us(lambda: repack_to_tile_pages(wl.k_cache, wl.v_cache, wl.batch)),
        "repack_to_tile_pages (FPV2_TRITON_RELAUNCH=0)": _without_relaunch(
            lambda: median_us(lambda: repack_to_tile_pages(wl.k_cache, wl.v_cache, wl.batch))
        ),
        "PagedPrefillBatch(check_values=False)": median_us(new_tile_batch),
        "paged_batch_struct (new batch)": median_us(lambda: structs.paged_batch_struct(new_tile_batch())),
        "paged_batch_struct (same batch)": median_us(lambda: structs.paged_batch_struct(tile)),
        "torch.empty x 3": median_us(
            lambda: [torch.empty(256, 128, 8, 128, dtype=torch.bfloat16, device=device) for _ in range(3)]
        ),
    }
    for name, us in rows.items():
        print(f"{name:45s} {us:8.1f} us")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
