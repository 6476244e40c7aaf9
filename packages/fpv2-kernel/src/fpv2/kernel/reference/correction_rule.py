"""The rule deciding which pruned blocks the mean correction adds back.

Eligible blocks of a tile are those fully visible to its first row,
``J < (prefix + p_first) // block_size``; blocks crossing the diagonal are
covered exactly by the forced window and diagonal band. A block is *todo* when
it is eligible and not kept. Kernels walk the eligible range in 64-block chunks
and skip chunks whose todo word is zero.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..contracts import CORRECTION_CHUNK, TileSpan


def todo_blocks(kept: Sequence[int], span: TileSpan) -> list[int]:
    """Eligible, not-kept block ids of one tile, ascending."""
    kept_set = set(kept)
    return [j for j in range(span.num_correctable_blocks) if j not in kept_set]


def todo_words(kept: Sequence[int], span: TileSpan, chunk: int = CORRECTION_CHUNK) -> list[int]:
    """The tile's todo bitmask, one signed 64-bit word per chunk of ``chunk`` eligible blocks.

    Bit ``i`` of word ``w`` is block ``w * chunk + i``; words are returned as
    signed ints so they fit an ``int64`` tensor unchanged.
    """
    n_words = -(-span.num_correctable_blocks // chunk)
    words = [0] * n_words
    for j in todo_blocks(kept, span):
        words[j // chunk] |= 1 << (j % chunk)
    return [w - (1 << 64) if w >= 1 << 63 else w for w in words]
