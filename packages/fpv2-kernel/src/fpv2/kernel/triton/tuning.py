"""Launch parameters of the Triton kernel: a small fixed table per head dimension (no autotuning at import).

The query tile is not tunable: ``BLOCK_M`` is the index tile size (128 packed
rows). What is tuned is the key sub-tile ``BLOCK_N`` (a key block of 128
tokens is processed as ``128 / BLOCK_N`` sub-tiles), the number of warps and
the software-pipelining depth of the unmasked block loop.

Table (chosen from ptxas resource usage with and without the mean correction,
then for ``d = 128`` timed on an H200, dense mode, B=1, L=16K, Hq/Hkv=32/8, bf16:
``(64, 8, 3)`` 6.27 ms, ``(128, 8, 3)`` 5.56 ms (395 TFLOP/s; torch SDPA flash
6.38 ms, cuDNN 3.75 ms), ``(64, 4, 3)`` 4.93 ms but it spills registers once the
correction is compiled in; e4m3: ``(128, 8, 3)`` 9.0 ms, ``(64, 8, 3)`` 10.1 ms):

======== ======= ========= ========== ===============
head dim BLOCK_N num_warps num_stages correction step
======== ======= ========= ========== ===============
64       64      4         3          64
128      128     8         3          64
256      32      8         2          32
======== ======= ========= ========== ===============

At ``d = 256`` the ``128 x 256`` fp32 accumulator takes half the registers of 8
warps: the plain loop fits without spilling, the correction step spills a little
(and FP8 at ``d = 256`` spills in the main loop too); the 64- and 256-dim rows are
not timed yet.
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


#: Launch parameters per head dimension (see the module docstring).
TUNING_TABLE: dict[int, LaunchConfig] = {
    64: LaunchConfig(block_n=64, num_warps=4, num_stages=3, correction_stages=1),
    128: LaunchConfig(block_n=128, num_warps=8, num_stages=3),
    256: LaunchConfig(block_n=32, num_warps=8, num_stages=2, correction_step=32),
}

#: Smallest key sub-tile ``tl.dot`` accepts.
MIN_BLOCK_N = 16


def launch_config(head_dim: int, block_size: int) -> LaunchConfig:
    """The launch parameters for ``head_dim``, with ``BLOCK_N`` clamped to the key block size.

    Args:
        head_dim: ``d`` (64, 128 or 256).
        block_size: tokens per key block of the index (a power of two >= 16).

    Returns:
        The :class:`LaunchConfig` to compile and launch with.

    Raises:
        ValueError: ``head_dim`` has no entry, or ``block_size`` is below 16.
    """
    if head_dim not in TUNING_TABLE:
        raise ValueError(f"head_dim={head_dim} has no Triton launch configuration; supported: {sorted(TUNING_TABLE)}")
    if block_size < MIN_BLOCK_N:
        raise ValueError(f"block_size={block_size} is below the smallest key sub-tile {MIN_BLOCK_N} of the kernel")
    config = TUNING_TABLE[head_dim]
    if config.block_n > block_size:
        config = dataclasses.replace(config, block_n=block_size)
    return config
