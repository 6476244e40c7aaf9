"""Keep bits -> CSR: block ids written in place, ascending, at the offsets the selection kernel wrote.

The selection kernel leaves one bit per (segment, block), one count per
segment and ``offsets = [0, cumsum(counts)]`` (its last program scans the
counts; :func:`segment_offsets` is the same scan in torch, the reference the
tests hold it to). Then one program per segment expands its bits ``BITS`` at
a time (the whole segment row, up to 1024 blocks, in one step at 128K tokens),
ranks the set bits with a prefix sum and writes their block ids to
``blocks[offsets[s] + rank]``. A program stops as soon as it has written its
segment's count. Words past those the selection kernel wrote for the segment
(but inside its row) may be read in the last step: their bits rank at or after
``count`` (every written bit comes first), so they are never stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launcher import Relauncher
from .tuning import next_power_of_2
from .workspace import WORD_BITS

#: Largest number of keep bits expanded per step.
MAX_STEP_BITS = 1024


@triton.jit
def _compact_kernel(
    keep_bits_ptr,
    offsets_ptr,
    blocks_ptr,
    bits_stride,
    num_words,
    BITS: tl.constexpr,
    WORD: tl.constexpr,
):
    segment = tl.program_id(0)
    base = tl.load(offsets_ptr + segment)
    count = tl.load(offsets_ptr + segment + 1) - base
    bits_row = keep_bits_ptr + segment.to(tl.int64) * bits_stride
    lanes = tl.arange(0, WORD)
    step = tl.arange(0, BITS)
    words_i = tl.arange(0, BITS // WORD)
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


def launch_compact(keep_bits: torch.Tensor, offsets: torch.Tensor, blocks: torch.Tensor) -> None:
    """Write every segment's kept block ids to ``blocks``, ascending, at its offset.

    Args:
        keep_bits: ``(S, W) int32`` keep bits (bit ``i`` of word ``w`` is block ``32 * w + i``).
        offsets: ``(S+1,) int32`` CSR offsets.
        blocks: ``(>= offsets[-1],) int32`` output; entries past ``offsets[-1]`` are left as they are.
    """
    num_segments = offsets.numel() - 1
    if num_segments == 0:
        return
    words = keep_bits.shape[1]
    bits = min(MAX_STEP_BITS, max(WORD_BITS, next_power_of_2(words * WORD_BITS)))
    _COMPACT(
        (num_segments,),
        keep_bits,
        offsets,
        blocks,
        keep_bits.stride(0),
        words,
        BITS=bits,
        WORD=WORD_BITS,
        num_warps=4 if bits >= 512 else 2,
    )
