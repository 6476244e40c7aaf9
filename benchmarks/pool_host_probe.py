"""Host time of the pooling call at 128K (page 128, 32/8 heads, d 128) on an idle GPU, and of its parts.

Prints the median host microseconds of ``pool_blocks_triton`` (with and without the bf16 pooled
copies), of its relaunch's specialisation key and of the relaunch itself, of ``fresh_outputs`` for the
seven output parts and of one ``torch.empty``, and whether the calls took the direct relaunch. Each
sample starts after a ``torch.cuda.synchronize``, as a pipeline call on an idle GPU does.

Usage (the packages' ``src`` on ``PYTHONPATH``, on a GPU): ``python benchmarks/pool_host_probe.py``
"""

from __future__ import annotations

import torch

from fpv2.index.triton import pool_blocks_triton, pooling
from fpv2.index.triton.outputs import fresh_outputs
from fpv2.kernel.testing import planted_workload
from fpv2.serving.timing import idle_host_us as median_us


class RecordingLauncher:
    """Stands in for the pooling module's launcher: records the last launch, then launches it."""

    def __init__(self, launcher: pooling.Relauncher) -> None:
        self.launcher = launcher
        self.grid: tuple[int, ...] = ()
        self.args: tuple[object, ...] = ()
        self.meta: dict[str, object] = {}

    def __call__(self, grid, *args, **meta) -> None:
        self.grid, self.args, self.meta = grid, args, meta
        self.launcher(grid, *args, **meta)


def main() -> None:
    w = planted_workload(
        [131072], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=128, device=torch.device("cuda"), seed=0
    )
    real = pooling._POOL
    recorder = RecordingLauncher(real)
    pooling._POOL = recorder
    device = torch.cuda.current_device()
    for copies in (None, torch.bfloat16):

        def pool(copies: torch.dtype | None = copies) -> object:
            return pool_blocks_triton(w.k_cache, w.v_cache, w.batch, pooled_copy_dtype=copies)

        pool()
        pool()
        direct, normal = real.direct, real.normal
        us = median_us(pool)
        print(
            "copies",
            copies,
            "pool_blocks_triton us",
            us,
            "direct/normal delta",
            real.direct - direct,
            real.normal - normal,
        )
        key_us = median_us(lambda: real.key(device, recorder.args, recorder.meta))
        relaunch_us = median_us(lambda: real(recorder.grid, *recorder.args, **recorder.meta))
        print("  key us", key_us, "relaunch us", relaunch_us)
    pooling._POOL = real
    shape = (1024, 8, 128)
    parts = [(shape, torch.float32)] * 2 + [(shape, torch.bfloat16)] * 3 + [((1024,), torch.int32), ((2,), torch.int32)]
    print("fresh_outputs 7 parts us", median_us(lambda: fresh_outputs(w.q.device, parts)))
    print("torch.empty us", median_us(lambda: torch.empty(8 << 20, dtype=torch.uint8, device="cuda")))


if __name__ == "__main__":
    main()
