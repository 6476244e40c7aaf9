"""Routing curves measured on the device, shipped so that routing works without a measurement of one's own.

:data:`H200_TABLE` holds the routing curves ``benchmarks/routing_switch_point.py``
wrote on the lent H200: planted workload, B=1, no prefix, Hq=32, Hkv=8, d=128,
bf16, ``alpha = 0.1``, the sparse pipeline with the correction against the
backend's dense mode, medians of 10 CUDA-event runs.

- page size 1 (2026-12-03, ``benchmarks/results/2026-12-03-h200-gather-pairs-only/routing-page1-hopper/``),
  the Hopper kernel's cp.async gather (its two-lane version of that day; the
  four-lane one that replaced it is faster still), which ``auto`` runs at page size 1 since
  then: sparse wins from about 8,934 KV tokens on (2.38x at 16K, 5.72x at 32K);
  at 8K it is 1.13x slower than dense (on the Triton backends of 2026-11-29 the
  switch was at 10,069 tokens, 4.48x at 32K);
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
        "created": "2026-12-03T13:43:08+00:00",
        "gpu": "NVIDIA H200",
        "source": "benchmarks/results/2026-12-03-h200-gather-pairs-only/routing-page1-hopper/routing-table.json "
        "(page size 1) and benchmarks/results/2026-12-01-h200-serving-gpu/ (page size 128)",
    },
    "curves": [
        {
            "key": {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16", "page_size": 1, "alpha": 0.1},
            "points": [
                {"kv_len": 2048, "sparse_ms": 0.7777, "dense_ms": 0.2009, "density": 0.8398},
                {"kv_len": 4096, "sparse_ms": 0.9774, "dense_ms": 0.4171, "density": 0.6564},
                {"kv_len": 8192, "sparse_ms": 1.4648, "dense_ms": 1.2937, "density": 0.4896},
                {"kv_len": 16384, "sparse_ms": 1.9513, "dense_ms": 4.6528, "density": 0.1897},
                {"kv_len": 32768, "sparse_ms": 3.2600, "dense_ms": 18.6594, "density": 0.0946},
            ],
            "meta": {
                "gpu": "NVIDIA H200",
                "backend": "hopper",
                "dense_path": "kernel",
                "strategy": "max_threshold",
                "correction": True,
                "workload": "planted",
                "repeats": 10,
                "commit": "fpv2-kernel 0.1.1 (the two-lane gather), 2026-12-03",
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
