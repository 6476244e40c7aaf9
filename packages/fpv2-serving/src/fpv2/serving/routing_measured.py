"""Routing curves measured on the device, shipped so that routing works without a measurement of one's own.

:data:`H200_TABLE` holds the routing curves ``benchmarks/routing_switch_point.py``
wrote on the lent H200: planted workload, B=1, no prefix, Hq=32, Hkv=8, d=128,
bf16, ``alpha = 0.1``, the sparse pipeline with the correction against the
backend's dense mode, medians of 10 CUDA-event runs.

- page sizes 1 and 16 (2026-12-04, ``benchmarks/results/2026-12-04-h200-page1-profile/routing-repack/``),
  the Hopper kernel after the tile repack (both paths copy the call's KV into
  128-token pages first, as ``auto`` does for whole prompts): at page size 1
  sparse wins from about 9,078 KV tokens on (1.79x at 16K, 4.59x at 32K; 1.11x
  slower than dense at 8K), at page size 16 from about 9,918 (1.82x at 16K,
  4.81x at 32K). The copy made both paths faster (32K: sparse 3.26 -> 3.04 ms,
  dense 18.66 -> 13.92 ms against the cp.async gather of 2026-12-03, whose
  switch point was 8,934 tokens), dense more than sparse, so the switch moved up
  a little;
- page size 128 (2026-12-01, ``benchmarks/results/2026-12-01-h200-serving-gpu/``),
  the Hopper kernel: sparse wins from about 9,219 KV tokens on (1.74x at 16K,
  5.59x at 32K); at 8K it is 1.12x slower than dense.

:func:`measured_table` hands the table to the router only on the GPU it was
measured on (by device name); other GPUs, and other keys on this one (page
sizes, head shapes, ``alpha``), keep the default rule until measured.
"""

from __future__ import annotations

import torch

from .routing import RoutingTable

#: The H200 routing table (schema ``fpv2-routing/1``), rounded to 0.1 microsecond.
H200_TABLE: dict[str, object] = {
    "schema": "fpv2-routing/1",
    "meta": {
        "created": "2026-12-04T09:46:37+00:00",
        "gpu": "NVIDIA H200",
        "source": "benchmarks/results/2026-12-04-h200-page1-profile/routing-repack/routing-table.json "
        "(page sizes 1 and 16) and benchmarks/results/2026-12-01-h200-serving-gpu/ (page size 128)",
    },
    "curves": [
        {
            "key": {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16", "page_size": 1, "alpha": 0.1},
            "points": [
                {"kv_len": 2048, "sparse_ms": 0.8442, "dense_ms": 0.2930, "density": 0.8398},
                {"kv_len": 4096, "sparse_ms": 0.9087, "dense_ms": 0.4315, "density": 0.6564},
                {"kv_len": 8192, "sparse_ms": 1.1493, "dense_ms": 1.0390, "density": 0.4896},
                {"kv_len": 16384, "sparse_ms": 1.9949, "dense_ms": 3.5642, "density": 0.1897},
                {"kv_len": 32768, "sparse_ms": 3.0352, "dense_ms": 13.9211, "density": 0.0946},
            ],
            "meta": {
                "gpu": "NVIDIA H200",
                "backend": "hopper",
                "dense_path": "kernel",
                "strategy": "max_threshold",
                "correction": True,
                "workload": "planted",
                "repeats": 10,
                "commit": "59b7ca7 (fpv2-kernel 0.1.2, the tile repack), 2026-12-04",
            },
        },
        {
            "key": {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16", "page_size": 16, "alpha": 0.1},
            "points": [
                {"kv_len": 2048, "sparse_ms": 0.9901, "dense_ms": 0.3790, "density": 0.7580},
                {"kv_len": 4096, "sparse_ms": 1.0016, "dense_ms": 0.4431, "density": 0.5283},
                {"kv_len": 8192, "sparse_ms": 1.4066, "dense_ms": 1.1188, "density": 0.4079},
                {"kv_len": 16384, "sparse_ms": 1.8411, "dense_ms": 3.3576, "density": 0.2018},
                {"kv_len": 32768, "sparse_ms": 2.8370, "dense_ms": 13.6496, "density": 0.1031},
            ],
            "meta": {
                "gpu": "NVIDIA H200",
                "backend": "hopper",
                "dense_path": "kernel",
                "strategy": "max_threshold",
                "correction": True,
                "workload": "planted",
                "repeats": 10,
                "commit": "59b7ca7 (fpv2-kernel 0.1.2, the tile repack), 2026-12-04",
            },
        },
        {
            "key": {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16", "page_size": 128, "alpha": 0.1},
            "points": [
                {"kv_len": 2048, "sparse_ms": 0.9673, "dense_ms": 0.1963, "density": 0.8380},
                {"kv_len": 4096, "sparse_ms": 0.7973, "dense_ms": 0.3301, "density": 0.5693},
                {"kv_len": 8192, "sparse_ms": 1.0526, "dense_ms": 0.9396, "density": 0.4862},
                {"kv_len": 16384, "sparse_ms": 1.8974, "dense_ms": 3.2989, "density": 0.2356},
                {"kv_len": 32768, "sparse_ms": 2.5460, "dense_ms": 14.2274, "density": 0.0896},
            ],
            "meta": {
                "gpu": "NVIDIA H200",
                "backend": "hopper",
                "dense_path": "kernel",
                "strategy": "max_threshold",
                "correction": True,
                "workload": "planted",
                "repeats": 10,
                "commit": "166c5a9 (kernel library of 28895bb)",
            },
        },
    ],
}

#: Measured tables by the CUDA device name they were measured on.
MEASURED_TABLES: dict[str, dict[str, object]] = {"NVIDIA H200": H200_TABLE}


def measured_table(device: torch.device | str | None = None) -> RoutingTable | None:
    """The shipped routing table measured on this GPU model, or None.

    Args:
        device: the CUDA device whose name is looked up (None: the current device).

    Returns:
        The :class:`~.routing.RoutingTable`, or None without CUDA or for a GPU with no shipped measurement.
    """
    if not torch.cuda.is_available():
        return None
    if device is not None and torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    data = MEASURED_TABLES.get(name)
    return RoutingTable.from_dict(data) if data is not None else None
