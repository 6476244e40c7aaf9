"""Keep bits -> CSR: block ids written in place, ascending, at the offsets the selection kernel wrote.

The selection kernel leaves one bit per (segment, block), one count per
segment and ``offsets = [0, cumsum(counts)]`` (its last program scans the
counts; :func:`segment_offsets` is the same scan in torch, the reference the
tests hold it to). Then each program expands the rows of ``SEGS`` consecutive
segments ``BITS`` at a time (a ``[SEGS, BITS]`` tile; the whole row, up to
1024 blocks, in one step at 128K tokens), ranks each row's set bits with a
prefix sum along the row and writes their block ids to
``blocks[offsets[s] + rank]``. One segment per program is the default: the
several-segment tile (tried because each tiny program waits on its offsets,
then its words, then stores: 62 us for 32768 segments on an H200 at 128K)
measured 5% slower there (63.1 against 60.0 us,
``results/2026-12-01-h200-compaction-ab``) and stays for A/B
(``segments_per_program=FILL`` or a power of two). A program loops until every
one of its segments has written its count; a segment already done loads and
stores nothing more. Words past those the selection kernel wrote for the
segment (but inside its row) may be read in the last step: their bits rank at
or after ``count`` (every written bit comes first), so they are never stored,
and a stored rank lies in ``[0, count)``: no bit writes outside its own
segment's range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fpv2.kernel.triton.relaunch import Relauncher

from .tuning import next_power_of_2
from .workspace import WORD_BITS

#: Largest number of keep bits expanded per step (per segment row).
MAX_STEP_BITS = 1024
#: Largest ``[SEGS, BITS]`` tile of one program's step, in bits.
MAX_TILE_BITS = 4096
#: Most segments one program handles.
MAX_SEGMENTS_PER_PROGRAM = 16
#: ``segments_per_program`` value that fills a ``MAX_TILE_BITS`` tile with as many segments as fit.
FILL = 0
#: Segments per program when the caller names none: 1, the measured faster launch on the H200.
DEFAULT_SEGMENTS_PER_PROGRAM = 1


@triton.jit
def _compact_kernel(
    keep_bits_ptr,
    offsets_ptr,
    blocks_ptr,
    bits_stride,
    num_words,
    num_segments,
    BITS: tl.constexpr,
    WORD: tl.constexpr,
    SEGS: tl.constexpr,
):
    lanes = tl.arange(0, WORD)
    step = tl.arange(0, BITS)
    words_i = tl.arange(0, BITS // WORD)
    if SEGS == 1:
        # The per-segment path, as it was before several segments per program (A/B).
        segment = tl.program_id(0)
        base = tl.load(offsets_ptr + segment)
        count = tl.load(offsets_ptr + segment + 1) - base
        bits_row = keep_bits_ptr + segment.to(tl.int64) * bits_stride
        written = count * 0
        w0 = count * 0
        while (written < count) & (w0 < num_words):
            word_ids = w0 + words_i
            words = tl.load(bits_row + word_ids, mask=word_ids < num_words, other=0)
            bits = tl.reshape((words[:, None] >> lanes[None, :]) & 1, (BITS,))
            rank = written + tl.cumsum(bits, axis=0) - 1
            tl.store(blocks_ptr + base + rank, w0 * WORD + step, mask=(bits != 0) & (rank < count))
            written += tl.sum(bits, axis=0)
            w0 += BITS // WORD
    else:
        first = tl.program_id(0) * SEGS
        segments = first + tl.arange(0, SEGS)
        live = segments < num_segments  # the last program may be partial
        # Both offset loads are independent and hit the same lines; masked segments get count 0.
        base = tl.load(offsets_ptr + segments, mask=live, other=0)
        count = tl.load(offsets_ptr + segments + 1, mask=live, other=0) - base
        rows = keep_bits_ptr + segments.to(tl.int64)[:, None] * bits_stride
        written = count * 0
        w0 = first * 0
        # Trip count: the longest of the program's segments.
        while (tl.max(count - written, axis=0) > 0) & (w0 < num_words):
            word_ids = w0 + words_i
            todo = written < count  # a segment done loads nothing more (and would store nothing anyway)
            words = tl.load(rows + word_ids[None, :], mask=todo[:, None] & (word_ids < num_words)[None, :], other=0)
            bits = tl.reshape((words[:, :, None] >> lanes[None, None, :]) & 1, (SEGS, BITS))
            rank = written[:, None] + tl.cumsum(bits, axis=1) - 1
            # rank >= written >= 0 on a set bit, rank < count: only the segment's own range is written.
            keep = (bits != 0) & (rank < count[:, None])
            tl.store(blocks_ptr + base[:, None] + rank, w0 * WORD + step[None, :], mask=keep)
            written += tl.sum(bits, axis=1)
            w0 += BITS // WORD


def segment_offsets(counts: torch.Tensor) -> torch.Tensor:
    """``(S+1,) int32`` CSR offsets ``[0, cumsum(counts)]`` computed on the device (no host sync).

    Args:
        counts: ``(S,) int32`` kept blocks per segment.

    Returns:
        The offsets, on ``counts``'s device.
    """
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=offsets[1:])
    return offsets


#: Launcher of the compaction kernel (direct relaunch of the compiled kernel, :mod:`.launcher`).
_COMPACT = Relauncher(_compact_kernel)


def compact_tiling(words: int, segments_per_program: int | None = None) -> tuple[int, int, int]:
    """The step width, segments per program and warps :func:`launch_compact` launches with.

    Args:
        words: int32 keep-bit words per segment row.
        segments_per_program: segments per program, a power of two; :data:`FILL` picks
            ``min(16, 4096 // BITS)`` (a tile of at most 4096 bits); None is
            :data:`DEFAULT_SEGMENTS_PER_PROGRAM` (1, the per-segment path).

    Returns:
        ``(BITS, SEGS, num_warps)``.

    Raises:
        ValueError: when ``segments_per_program`` is not FILL, None or a positive power of two.
    """
    bits = min(MAX_STEP_BITS, max(WORD_BITS, next_power_of_2(words * WORD_BITS)))
    if segments_per_program is None:
        segments_per_program = DEFAULT_SEGMENTS_PER_PROGRAM
    if segments_per_program == FILL:
        fit = max(1, min(MAX_SEGMENTS_PER_PROGRAM, MAX_TILE_BITS // bits))
        segs = 1 << (fit.bit_length() - 1)  # largest power of two <= fit (tl.arange needs one)
    elif segments_per_program < 1 or segments_per_program & (segments_per_program - 1):
        raise ValueError(
            f"segments_per_program must be FILL (0), None or a positive power of two, got {segments_per_program}"
        )
    else:
        segs = segments_per_program
    if segs == 1:
        num_warps = 4 if bits >= 512 else 2  # the per-segment path's launch, unchanged
    else:
        num_warps = 4 if segs * bits >= 2048 else 2  # not measured on a GPU yet
    return bits, segs, num_warps


def launch_compact(
    keep_bits: torch.Tensor,
    offsets: torch.Tensor,
    blocks: torch.Tensor,
    *,
    segments_per_program: int | None = None,
) -> None:
    """Write every segment's kept block ids to ``blocks``, ascending, at its offset.

    Args:
        keep_bits: ``(S, W) int32`` keep bits (bit ``i`` of word ``w`` is block ``32 * w + i``).
        offsets: ``(S+1,) int32`` CSR offsets.
        blocks: ``(>= offsets[-1],) int32`` output; entries past ``offsets[-1]`` are left as they are.
        segments_per_program: segments one program expands, a power of two, or :data:`FILL` (as many
            as a 4096-bit tile holds); None (default) is :data:`DEFAULT_SEGMENTS_PER_PROGRAM`
            (:func:`compact_tiling`).
    """
    num_segments = offsets.numel() - 1
    if num_segments == 0:
        return
    words = keep_bits.shape[1]
    bits, segs, num_warps = compact_tiling(words, segments_per_program)
    _COMPACT(
        (triton.cdiv(num_segments, segs),),
        keep_bits,
        offsets,
        blocks,
        keep_bits.stride(0),
        words,
        num_segments,
        BITS=bits,
        WORD=WORD_BITS,
        SEGS=segs,
        num_warps=num_warps,
    )
