"""Prefix sum of the per-segment counts into the CSR offsets, inside one program.

The fused selection kernel's last program to finish calls :func:`scan_counts`
(:mod:`.scoring` explains how it knows it is last), so the host launches no
separate scan. Counts are read through L2 (``.cg``): they were written by
other programs of the same grid, never by this SM's L1. One step sums
``SCAN`` counts; a few hundred thousand segments take a few dozen steps.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scan_counts(counts_ptr, offsets_ptr, num_segments, zero, SCAN: tl.constexpr):
    """``offsets[1 + s] = counts[0] + ... + counts[s]`` for every ``s < num_segments`` (int32).

    ``zero`` is an int32 tensor 0 of the caller (not a literal: the carries are loop-carried
    tensors, and Triton specialises an int argument equal to 1 into a constant).
    """
    carry = zero
    s0 = zero
    while s0 < num_segments:  # a while loop: the interpreter's range() cannot take a tensor bound
        ids = s0 + tl.arange(0, SCAN)
        ok = ids < num_segments
        counts = tl.load(counts_ptr + ids, mask=ok, other=0, cache_modifier=".cg")
        tl.store(offsets_ptr + 1 + ids, carry + tl.cumsum(counts, axis=0), mask=ok)
        carry += tl.sum(counts, axis=0)
        s0 += SCAN
