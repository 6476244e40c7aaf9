"""The compaction kernel with several segments per program against a pure-torch expectation.

CPU runs use the Triton interpreter (``TRITON_INTERPRET=1``); without it the
same tests run natively on CUDA. Each case packs random keep bits, gives every
segment a count at most its popcount (the bits after the count-th set bit play
the garbage the selection kernel may leave in words it did not write) and
checks ``blocks[:offsets[-1]]`` against the first ``count`` set bits of each
row, and that a sentinel tail past ``offsets[-1]`` is left untouched. Segment
counts are not multiples of the segments per program, so the last program is
partial.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fpv2.index.triton import compaction, interpreter_enabled
from fpv2.index.triton.compaction import FILL, compact_tiling, launch_compact, segment_offsets

INTERPRET = interpreter_enabled()
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRET else "cuda"

pytestmark = pytest.mark.skipif(
    not (INTERPRET or HAS_CUDA),
    reason="the Triton compaction needs a CUDA GPU or the Triton interpreter (TRITON_INTERPRET=1)",
)

#: Value of every ``blocks`` entry before the launch; one left past ``offsets[-1]`` must stay.
SENTINEL = -7
#: Entries of ``blocks`` past ``offsets[-1]``.
TAIL = 37


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """``(S, 32 W) bool`` -> ``(S, W) int32`` words, bit ``i`` of word ``w`` = column ``32 w + i``."""
    segments, width = mask.shape
    bit_values = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (mask.view(segments, width // 32, 32).long() * bit_values).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def _case(num_segments: int, words: int, seed: int, density: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keep bits and counts <= popcount (garbage after the count), with empty segments.

    Returns:
        ``(mask, counts)``: ``(S, 32 W) bool`` bits and ``(S,) int32`` counts.
    """
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(num_segments, words * 32, generator=gen) < density
    popcount = mask.sum(1)
    counts = (torch.rand(num_segments, generator=gen) * (popcount + 1)).long().clamp(max=popcount)
    full = torch.rand(num_segments, generator=gen) < 0.5
    counts = torch.where(full, popcount, counts)  # half the segments without garbage
    if num_segments > 1:
        mask[1] = False  # an empty row
        counts[1] = 0
    if num_segments > 2:
        counts[num_segments - 1] = 0  # an empty segment whose row holds only garbage
    return mask, counts.to(torch.int32)


def _expected(mask: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The first ``counts[s]`` set columns of every row, concatenated."""
    rows = [torch.nonzero(row)[:count, 0] for row, count in zip(mask, counts.tolist(), strict=True)]
    return torch.cat(rows).to(torch.int32) if rows else torch.zeros(0, dtype=torch.int32)


def _run(
    mask: torch.Tensor,
    counts: torch.Tensor,
    segments_per_program: int | None,
    *,
    row_pad: int = 0,
) -> None:
    """Launch the compaction on ``mask``/``counts`` and check output and sentinel tail.

    ``row_pad`` extra words per row make the keep bits a strided view (rows longer than ``W``).
    """
    words = mask.shape[1] // 32
    packed = _pack(mask)
    if row_pad:
        wide = torch.full((packed.shape[0], words + row_pad), -1, dtype=torch.int32)  # all bits set: must stay unread
        wide[:, :words] = packed
        keep_bits = wide.to(DEVICE)[:, :words]
    else:
        keep_bits = packed.to(DEVICE)
    offsets = segment_offsets(counts.to(DEVICE))
    nnz = int(offsets[-1])
    blocks = torch.full((nnz + TAIL,), SENTINEL, dtype=torch.int32, device=DEVICE)
    launch_compact(keep_bits, offsets, blocks, segments_per_program=segments_per_program)
    got = blocks.cpu()
    assert torch.equal(got[:nnz], _expected(mask, counts))
    assert torch.all(got[nnz:] == SENTINEL)


@pytest.mark.parametrize("segments_per_program", [None, FILL, 1], ids=["default", "fill", "per-segment"])
@pytest.mark.parametrize("words", [1, 2, 8, 32, 40])
@pytest.mark.parametrize("num_segments", [1, 3, 17, 100])
def test_compaction_segments_match_torch(num_segments: int, words: int, segments_per_program: int | None) -> None:
    mask, counts = _case(num_segments, words, seed=7 * num_segments + words)
    _run(mask, counts, segments_per_program)


@pytest.mark.parametrize("segments_per_program", [2, 8, 32])
def test_compaction_explicit_segments_strided_rows(segments_per_program: int) -> None:
    mask, counts = _case(21, 8, seed=segments_per_program, density=0.6)
    _run(mask, counts, segments_per_program, row_pad=3)


@pytest.mark.parametrize("segments_per_program", [None, FILL, 1], ids=["default", "fill", "per-segment"])
def test_compaction_segments_loop_over_steps(segments_per_program: int | None, monkeypatch) -> None:
    # 64-bit steps: 8-word rows take up to 4 steps; segments of a program finish after different steps.
    monkeypatch.setattr(compaction, "MAX_STEP_BITS", 64)
    assert compact_tiling(8, FILL) == (64, 16, 2)
    mask, counts = _case(37, 8, seed=11)
    counts[0] = 1  # done after the first step while the others go on
    _run(mask, counts, segments_per_program)


@pytest.mark.parametrize("segments_per_program", [None, FILL, 1], ids=["default", "fill", "per-segment"])
def test_compaction_segments_all_empty(segments_per_program: int | None) -> None:
    mask = torch.rand(19, 64, generator=torch.Generator().manual_seed(5)) < 0.5  # garbage only
    _run(mask, torch.zeros(19, dtype=torch.int32), segments_per_program)


def test_compaction_tiling_rule() -> None:
    # (words -> BITS, SEGS, num_warps): tiles of at most 4096 bits, 4 warps from 2048 bits.
    assert compact_tiling(1, FILL) == (32, 16, 2)
    assert compact_tiling(2, FILL) == (64, 16, 2)
    assert compact_tiling(4, FILL) == (128, 16, 4)
    assert compact_tiling(8, FILL) == (256, 16, 4)  # 32K tokens
    assert compact_tiling(16, FILL) == (512, 8, 4)
    assert compact_tiling(32, FILL) == (1024, 4, 4)  # 128K tokens
    assert compact_tiling(40, FILL) == (1024, 4, 4)  # rows past one step loop
    assert compact_tiling(8, 1) == (256, 1, 2)  # the per-segment launch, as before
    assert compact_tiling(32, 1) == (1024, 1, 4)
    # The default is the per-segment launch (measured faster on the H200 at 128K).
    assert compact_tiling(32) == compact_tiling(32, 1) and compact_tiling(8) == compact_tiling(8, 1)
    for bad in (3, -2, 6):
        with pytest.raises(ValueError, match="power of two"):
            compact_tiling(8, bad)
