"""Launch parameters of the Triton kernel: a small fixed table per head dimension (no autotuning at import).

The query tile is not tunable: ``BLOCK_M`` is the index tile size (128 packed
rows). What is tuned is the key sub-tile ``BLOCK_N`` (a key block of 128
tokens is processed as ``128 / BLOCK_N`` sub-tiles), the number of warps and
the software-pipelining depth of the unmasked block loop.

Table (first chosen for an H200 from the register/shared-memory budget, then
checked there; see the module's tests for the shapes it is run on):

======== ======= ========= ==========
head dim BLOCK_N num_warps num_stages
======== ======= ========= ==========
64       64      4         3
128      64      8         3
256      32      8         2
======== ======= ========= ==========

Larger ``BLOCK_N`` at ``d = 256`` exceeds the shared memory of one program
with three stages; fewer warps at ``d >= 128`` spill the ``128 x d`` fp32
accumulator.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """Compile-time launch parameters of one kernel variant.

    Args:
        block_n: keys per sub-tile (divides the key block size).
        num_warps: warps per program.
        num_stages: software-pipelining depth of the unmasked block loop.
    """

    block_n: int
    num_warps: int
    num_stages: int


#: Launch parameters per head dimension (see the module docstring).
TUNING_TABLE: dict[int, LaunchConfig] = {
    64: LaunchConfig(block_n=64, num_warps=4, num_stages=3),
    128: LaunchConfig(block_n=64, num_warps=8, num_stages=3),
    256: LaunchConfig(block_n=32, num_warps=8, num_stages=2),
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
        config = LaunchConfig(block_size, config.num_warps, config.num_stages)
    return config
