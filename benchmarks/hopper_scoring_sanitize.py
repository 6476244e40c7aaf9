"""One small Hopper scoring call for compute-sanitizer (memcheck, racecheck): two requests with a cached prefix,
32/8 heads, d = 128, bf16, reference pooling (so that the scoring kernels are nearly the only launches).

Usage (the packages' ``src`` on ``PYTHONPATH``, on an sm_90 GPU with the native library):
``compute-sanitizer --tool memcheck --kernel-name kns=score python benchmarks/hopper_scoring_sanitize.py``
"""

from __future__ import annotations

import os

import torch

from fpv2.index.config import SelectionConfig
from fpv2.index.triton import select_blocks_triton
from fpv2.index.triton.hopper_scoring import SCORING_ENV
from fpv2.kernel.reference.pooling import pool_blocks
from fpv2.kernel.testing import planted_workload


def main() -> None:
    os.environ[SCORING_ENV] = "hopper"
    w = planted_workload([1500, 700], [6000, 700], num_q_heads=32, num_kv_heads=8, head_dim=128, device="cuda")
    index = select_blocks_triton(w.q, w.batch, pool_blocks(w.k_cache, None, w.batch), config=SelectionConfig())
    torch.cuda.synchronize()
    print(f"scored: {int(index.offsets[-1])} kept (segment, block) pairs over {index.num_segments} segments")


if __name__ == "__main__":
    main()
