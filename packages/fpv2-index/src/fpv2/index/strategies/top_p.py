"""Top-p (cumulative mass) selection: per tile, the fewest blocks holding a share ``p`` of the energy.

Energies are the max-threshold selector's (see :mod:`.top_k`). The forced
candidates are kept anyway, so their energy counts first; unforced candidates
are then added in decreasing energy until the kept candidates hold at least
``p`` of the tile's total candidate energy. The result is the smallest set of
candidates that contains the forced ones and reaches the share ``p``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import SelectionConfig
from .registry import register_strategy
from .streaming import ForcedPlusExtraSelection, HeadSelectionInputs
from .top_k import candidate_energies


def top_p_mask(energies: torch.Tensor, candidates: torch.Tensor, forced: torch.Tensor, p: float) -> torch.Tensor:
    """``(T, nb) bool``: per row, the fewest unforced candidates that bring the kept energy share to ``p``.

    Per row with candidate energies ``E`` (total ``Z``) and forced-candidate
    energy ``F``: sort the unforced candidates by decreasing energy (ties to the
    lower id) and keep the shortest prefix with ``F + prefix sum >= p * Z``.
    Sums run in float64; blocks of zero energy are never needed; a row with
    ``Z = 0`` keeps nothing.

    Args:
        energies: ``(T, nb)`` non-negative energies.
        candidates: ``(T, nb) bool`` scored candidates.
        forced: ``(T, nb) bool`` blocks kept regardless (only their candidate part carries energy).
        p: mass share in ``(0, 1]``.

    Returns:
        The chosen unforced candidates.
    """
    if energies.shape[1] == 0:
        return torch.zeros_like(candidates)
    energy = energies.double().masked_fill(~candidates, 0.0)
    forced_mass = energy.masked_fill(~forced, 0.0).sum(dim=1)
    rankable = candidates & ~forced
    # Non-rankable entries sort last (energies are >= 0) and are never taken.
    ranked, order = torch.sort(energy.masked_fill(~rankable, -1.0), dim=1, descending=True, stable=True)
    mass = ranked.clamp(min=0.0)
    cumulative = mass.cumsum(dim=1)
    # Total from the same sums, so that p = 1 reaches it exactly and zero-energy blocks stay out.
    target = p * (forced_mass + cumulative[:, -1])
    before = forced_mass[:, None] + torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    take = (before < target[:, None]) & (ranked > 0)
    return torch.zeros_like(candidates).scatter_(1, order, take)


@register_strategy("top_p")
@dataclass(frozen=True)
class TopPStrategy(ForcedPlusExtraSelection):
    """Per tile, the forced blocks plus the fewest scored blocks that bring the kept energy share to ``p``.

    The budget adapts to the tile: a flat energy profile keeps many blocks, a
    peaked one few. The share is taken over the tile's candidate blocks
    (``J < num_scored``) and their max-threshold energies; the forced candidates
    count towards it. Dense-fallback tiles keep every visible block.
    ``config.alpha`` is ignored, ``config.probe_stride`` applies.

    Args:
        p: energy share in ``(0, 1]``; larger is denser. Default ``0.9``.

    Raises:
        TypeError: ``p`` is not a real number.
        ValueError: ``p`` is outside ``(0, 1]`` or NaN.

    Attributes:
        name: ``"top_p"``.
    """

    p: float = 0.9
    name: ClassVar[str] = "top_p"

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)):
            raise TypeError(f"TopPStrategy.p must be a float, got {type(self.p).__name__} {self.p!r}")
        if not (math.isfinite(self.p) and 0.0 < self.p <= 1.0):
            raise ValueError(f"TopPStrategy.p must lie in (0, 1], got {self.p}")

    def extra_blocks(self, inputs: HeadSelectionInputs, config: SelectionConfig) -> torch.Tensor:
        """The minimal high-energy unforced candidates of every sparse tile of one (request, KV head).

        Args:
            inputs: the (request, KV head).
            config: selection parameters.

        Returns:
            ``(T, nb) bool`` chosen blocks (forced blocks not included).
        """
        energies, candidates = candidate_energies(inputs, config)
        return top_p_mask(energies, candidates, inputs.forced, float(self.p))
