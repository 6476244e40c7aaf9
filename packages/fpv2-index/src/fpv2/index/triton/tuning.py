"""Launch knobs of the Triton index kernels, in one place so benchmarks can sweep them.

The defaults are the measured best on an H200 for the standard shapes
(one 128K or 32K request, 32/8 heads, d 128, bf16, page size 1); see
``benchmarks/NOTES.md`` (index stage) and ``benchmarks/index_speed.py --sweep``.
Changing a field changes the compiled variant, never the result (up to the
near-threshold rounding of a different chunking).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ScoreTuning:
    """Knobs of the fused scoring/selection kernel.

    Attributes:
        block_n: pooled keys per scoring step (the MMA's M; 64 or 128).
        num_warps: warps per program (4 = one warpgroup; 8 pairs with ``block_n = 128``).
        num_stages: software-pipeline depth of the pooled-key loads.
        programs_per_sm: persistent programs per streaming multiprocessor.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2


@dataclass(frozen=True)
class PoolTuning:
    """Knobs of the pooling kernel.

    Attributes:
        tokens: tokens loaded per step (capped by the block size).
        num_warps: warps per program.
    """

    tokens: int = 32
    num_warps: int = 4


SCORE = ScoreTuning()
POOL = PoolTuning()


def set_tuning(*, score: ScoreTuning | None = None, pool: PoolTuning | None = None) -> tuple[ScoreTuning, PoolTuning]:
    """Replace the launch knobs (process-wide); returns the previous ones so a caller can restore them.

    Args:
        score: new scoring knobs, or None to keep them.
        pool: new pooling knobs, or None to keep them.

    Returns:
        ``(previous score knobs, previous pool knobs)``.

    Raises:
        ValueError: a knob is out of range.
    """
    global SCORE, POOL
    previous = (SCORE, POOL)
    if score is not None:
        if score.block_n not in (64, 128) or score.num_warps not in (4, 8) or score.num_stages < 1:
            raise ValueError(f"unsupported scoring knobs {score}")
        if score.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {score.programs_per_sm}")
        SCORE = replace(score)
    if pool is not None:
        if pool.tokens < 1 or pool.tokens & (pool.tokens - 1) or pool.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"unsupported pooling knobs {pool}")
        POOL = replace(pool)
    return previous
