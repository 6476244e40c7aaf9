"""Top-k selection: per tile, the ``k`` unforced candidate blocks with the largest energies.

Energies are the max-threshold selector's (:func:`fpv2.index.reference.block_energies`:
``E_J = sum_r 2^(s_rJ - M)`` over the tile's probed rows, candidates
``J < num_scored``), so the two strategies rank blocks identically and differ
only in the cut: a fixed count here, a ratio to the peak there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import SelectionConfig
from ..reference.scoring import block_energies
from ..reference.selection import MAX_LOGITS_PER_STEP
from .registry import register_strategy
from .streaming import ForcedPlusExtraSelection, HeadSelectionInputs


def candidate_energies(inputs: HeadSelectionInputs, config: SelectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Max-threshold energies of the candidate blocks of every sparse tile of one (request, KV head).

    Scores tiles in groups so that at most about ``MAX_LOGITS_PER_STEP`` logits
    exist at once, exactly as the reference max-threshold selector does.

    Args:
        inputs: the (request, KV head).
        config: selection parameters (``block_size``, ``probe_stride``).

    Returns:
        ``(energies, candidates)``: ``(T, nb) float32`` energies relative to each
        tile's maximum (0 outside candidates and on dense tiles) and the
        ``(T, nb) bool`` candidates of the sparse tiles (``J < num_scored``).
    """
    tiles, pooled = inputs.tiles, inputs.pooled_k
    num_tiles, nb = inputs.forced.shape
    energies = torch.zeros(num_tiles, nb, dtype=torch.float32, device=pooled.device)
    ids = torch.arange(nb, device=pooled.device)
    candidates = (ids[None, :] < tiles.num_scored_blocks[:, None]) & inputs.sparse[:, None]
    sparse = torch.nonzero(inputs.sparse).flatten()
    if sparse.numel() == 0:
        return energies, candidates
    num_scored = tiles.num_scored_blocks[sparse]
    width = int(num_scored.max())
    if width == 0:
        return energies, candidates
    positions = tiles.probe_positions(config.probe_stride)[sparse]
    step = max(1, MAX_LOGITS_PER_STEP // (inputs.rows.shape[1] * width))
    for begin in range(0, sparse.numel(), step):
        part = slice(begin, begin + step)
        scored, _ = block_energies(
            inputs.rows[sparse[part]],
            positions[part],
            num_scored[part],
            pooled[:width],
            scale=inputs.scale,
            block_size=config.block_size,
        )
        energies[sparse[part], :width] = scored
    return energies, candidates


def top_k_mask(energies: torch.Tensor, rankable: torch.Tensor, k: int) -> torch.Tensor:
    """``(T, nb) bool``: per row, the ``min(k, rankable count)`` rankable entries with the largest energies.

    Ties go to the lower block id (a stable sort), so the result is deterministic.

    Args:
        energies: ``(T, nb)`` scores.
        rankable: ``(T, nb) bool`` entries that may be chosen.
        k: entries to keep per row (``>= 0``).

    Returns:
        The chosen entries.
    """
    if energies.shape[1] == 0 or k == 0:
        return torch.zeros_like(rankable)
    score = energies.float().masked_fill(~rankable, -torch.inf)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    rank = torch.arange(energies.shape[1], device=energies.device)[None, :]
    take = (rank < k) & (rank < rankable.sum(dim=1, keepdim=True))
    return torch.zeros_like(rankable).scatter_(1, order, take)


@register_strategy("top_k")
@dataclass(frozen=True)
class TopKStrategy(ForcedPlusExtraSelection):
    """Per tile, the forced blocks plus the ``k`` unforced candidates with the largest energies.

    A fixed per-tile budget: a sparse tile keeps its forced blocks (sink, window,
    diagonal band) and exactly ``min(k, c)`` more, where ``c`` is the number of
    its candidate blocks that are not forced; dense-fallback tiles keep every
    visible block. Ranking uses the max-threshold energies; ``config.alpha`` is
    ignored, ``config.probe_stride`` applies.

    Args:
        k: scored blocks kept per tile beyond the forced ones (``>= 1``; for forced
            blocks only use ``"streaming"``). Default ``32`` (4096 tokens at ``Bk = 128``).

    Raises:
        TypeError: ``k`` is not an int.
        ValueError: ``k < 1``.

    Attributes:
        name: ``"top_k"``.
    """

    k: int = 32
    name: ClassVar[str] = "top_k"

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int):
            raise TypeError(f"TopKStrategy.k must be an int, got {type(self.k).__name__} {self.k!r}")
        if self.k < 1:
            raise ValueError(
                f"TopKStrategy.k must be >= 1, got {self.k}; the 'streaming' strategy keeps forced blocks only"
            )

    def extra_blocks(self, inputs: HeadSelectionInputs, config: SelectionConfig) -> torch.Tensor:
        """The top-``k`` unforced candidates of every sparse tile of one (request, KV head).

        Args:
            inputs: the (request, KV head).
            config: selection parameters.

        Returns:
            ``(T, nb) bool`` chosen blocks (forced blocks not included).
        """
        energies, candidates = candidate_energies(inputs, config)
        return top_k_mask(energies, candidates & ~inputs.forced, self.k)
