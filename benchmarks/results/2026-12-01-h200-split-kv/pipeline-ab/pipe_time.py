"""Median event time of the planted corrected pipeline call (for library A/B in separate processes).

Usage: ``python pipe_time.py L [B]`` with the packages' ``src`` on ``PYTHONPATH`` and ``FPV2_KERNEL_LIBRARY`` set.
"""

import sys

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline
from fpv2.serving.timing import median, timed_samples

length = int(sys.argv[1])
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
wl = planted_workload(
    [length] * batch,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=128,
    dtype=torch.bfloat16,
    device=torch.device("cuda"),
    seed=0,
)
pipe = SparsePrefillPipeline(SelectionConfig(alpha=0.1), correction=True, backend="auto")
stages = []
samples, _ = timed_samples(
    lambda: pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch),
    5,
    20,
    torch.device("cuda"),
    on_call=lambda result, timed: stages.append(result.timings) if timed else None,
)
attention = median([s.attention_ms for s in stages])
index = median([s.index_ms for s in stages])
print(
    f"L={length} B={batch} pipeline {median(samples):.3f} ms (min {min(samples):.3f}) "
    f"index {index:.3f} attention {attention:.3f}"
)
