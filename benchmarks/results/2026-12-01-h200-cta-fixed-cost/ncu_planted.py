"""One corrected and one uncorrected planted pipeline call at 128K (for ncu)."""

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline

wl = planted_workload(
    [131072],
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=128,
    dtype=torch.bfloat16,
    device=torch.device("cuda"),
    seed=0,
)
for correction in (True, False):
    pipe = SparsePrefillPipeline(SelectionConfig(alpha=0.1), correction=correction, backend="auto")
    pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    torch.cuda.synchronize()
print("done")
