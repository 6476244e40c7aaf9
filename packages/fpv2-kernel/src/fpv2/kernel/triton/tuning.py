"""Launch parameters of the Triton kernel: a small fixed table per head dimension and mode (no autotuning).

The query tile is not tunable: ``BLOCK_M`` is the index tile size (128 packed
rows). What is tuned is the key sub-tile ``BLOCK_N`` (a key block of 128
tokens is processed as ``128 / BLOCK_N`` sub-tiles), the number of warps, the
software-pipelining depth of the unmasked block loop, the correction step and
its pipelining depth, and the order of the grid. The three modes compile to
different kernels (``DENSE`` and ``CORRECTION`` are compile-time switches), so
each has its own entry: the mean correction needs the most registers, the dense
mode the fewest.

Base table (sparse with correction; also sparse without, unless overridden):

======== ======= ========= ========== =============== ================= =======
head dim BLOCK_N num_warps num_stages correction step correction stages reverse
======== ======= ========= ========== =============== ================= =======
64       64      4         3          64              1                 yes
128      128     8         3          64              1                 yes
256      32      8         2          32              2                 yes
======== ======= ========= ========== =============== ================= =======

Overrides (:data:`MODE_OVERRIDES`): the dense mode at ``d = 128`` runs with
``(64, 4, 3)``, bf16 and e4m3.

Measured for ``d = 128`` on an H200 (B=1, Hq/Hkv = 32/8, page size 1, planted
workload, attention kernel alone, CUDA-event medians; files under
``benchmarks/results/2026-11-29-h200-triton-tuning/``, ``call2-profile-394cde9.json``):

- sparse with correction, 128K (density 3.8%): table 22.68 ms; the same with a
  pipelined correction loop 22.91; ``(32, 4, 3)`` with steps of 32 or 16 pooled
  vectors 25.6-26.3 (two programs per SM, but it spills); steps of 128 spill
  (24.91 in call 1). The kernel before this table: 32.98 ms.
- sparse without correction, 128K: table 16.15 ms; grid in segment order 17.80;
  ``(32, 4, 3)`` 19.20; ``(64, 4, 3)`` 22.57 (spills). Before: 18.99 ms.
- dense, 32K: ``(64, 4, 3)`` 19.84 ms = 443 TFLOP/s (255 registers x 128 threads and
  98 KB of shared memory leave room for two programs per SM; ptxas spills a few);
  ``(64, 4, 2)`` 432, segment order 429, ``(128, 8, 3)`` 404 (417 in segment
  order), ``(32, 4, 3)`` 341-373. Before: 396.5 (363 in the first device run).
  e4m3: ``(64, 4, 3)`` 261 TFLOP/s, ``(128, 8, 3)`` 244.

Re-measured on an H100 on 2026-12-06, after the correction step lost its per-column
``log2`` (``benchmarks/results/2026-12-06-h100-triton-correction-step/``, kernel alone,
one process): against the table's step of 64 unpipelined, a pipelined correction loop
is +1.5% (128K) / +1.4% (32K), steps of 128 +7.4% / +5.1%, steps of 32 pipelined
+5.2% / +2.3%; the table stands.

Chosen without timing (ptxas resource usage only): the 64- and 256-dim rows (no
register spills with the correction compiled in; at ``d = 64`` a pipelined
correction loop spills, so it is not pipelined).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """Compile-time launch parameters of one kernel variant.

    Args:
        block_n: keys per sub-tile (divides the key block size).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the unmasked block loop.
        correction_step: pooled vectors per mean-correction step (a power of two from
            16 to 128; a step of 128 reads two todo words; smaller where registers are short).
        correction_stages: software-pipelining depth of the correction loop (1: none).
        reverse_grid: run the segments last to first, so that the late tiles of each
            request (the longest block lists) start first and short tiles fill the tail.
    """

    block_n: int
    num_warps: int
    num_stages: int
    correction_step: int = 64
    correction_stages: int = 2
    reverse_grid: bool = True


#: Launch parameters per head dimension (see the module docstring): sparse attention with correction.
TUNING_TABLE: dict[int, LaunchConfig] = {
    64: LaunchConfig(block_n=64, num_warps=4, num_stages=3, correction_stages=1),
    128: LaunchConfig(block_n=128, num_warps=8, num_stages=3, correction_stages=1),
    256: LaunchConfig(block_n=32, num_warps=8, num_stages=2, correction_step=32),
}

#: Kernel modes: dense (no index), sparse without correction, sparse with correction.
MODES = ("dense", "sparse", "correction")

#: Entries that differ from :data:`TUNING_TABLE` for one ``(head dim, mode, fp8)``.
MODE_OVERRIDES: dict[tuple[int, str, bool], LaunchConfig] = {
    # 4 warps: the accumulator and logits fit two programs per SM, which overlap each
    # other's softmax and products; with the correction compiled in this spills.
    (128, "dense", False): LaunchConfig(block_n=64, num_warps=4, num_stages=3),
    (128, "dense", True): LaunchConfig(block_n=64, num_warps=4, num_stages=3),
}

#: Smallest key sub-tile ``tl.dot`` accepts.
MIN_BLOCK_N = 16


def launch_config(head_dim: int, block_size: int, mode: str = "correction", *, fp8: bool = False) -> LaunchConfig:
    """The launch parameters for ``head_dim`` and ``mode``, with ``BLOCK_N`` clamped to the key block size.

    Args:
        head_dim: ``d`` (64, 128 or 256).
        block_size: tokens per key block of the index (a power of two >= 16).
        mode: ``"dense"`` (no index), ``"sparse"`` or ``"correction"`` (sparse with a plan).
        fp8: float8_e4m3fn inputs.

    Returns:
        The :class:`LaunchConfig` to compile and launch with.

    Raises:
        ValueError: ``head_dim`` has no entry, an unknown ``mode``, or ``block_size`` below 16.
    """
    if head_dim not in TUNING_TABLE:
        raise ValueError(f"head_dim={head_dim} has no Triton launch configuration; supported: {sorted(TUNING_TABLE)}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if block_size < MIN_BLOCK_N:
        raise ValueError(f"block_size={block_size} is below the smallest key sub-tile {MIN_BLOCK_N} of the kernel")
    config = MODE_OVERRIDES.get((head_dim, mode, fp8), TUNING_TABLE[head_dim])
    if config.block_n > block_size:
        config = dataclasses.replace(config, block_n=block_size)
    return config
