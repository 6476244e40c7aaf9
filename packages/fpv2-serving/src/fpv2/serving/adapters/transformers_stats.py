"""Counters of ``attn_implementation="fpv2"``: which calls went sparse, which went dense and why."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Fallback reason of single-token decode steps (dense by design).
DECODE = "decode"


@dataclass
class Fpv2AttentionStats:
    """What the fpv2 attention function did since registration (or the last :meth:`reset`).

    Attributes:
        pipeline_calls: layer calls served by the fpv2 pipeline (prefill).
        pipeline_tokens: queries of those calls, summed over batch rows.
        fallbacks: layer calls sent to transformers' sdpa, by reason;
            :data:`DECODE` counts single-token decode steps.
        densities: block density of each pipeline call (kept over causally
            visible (tile, block) pairs; 1.0 = dense), recorded only when
            ``track_density`` is on, since measuring it reads the index on the host.
        track_density: record :attr:`densities`.
    """

    pipeline_calls: int = 0
    pipeline_tokens: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    densities: list[float] = field(default_factory=list)
    track_density: bool = False

    @property
    def decode_calls(self) -> int:
        """Layer calls of single-token decode steps (dense fallback)."""
        return self.fallbacks.get(DECODE, 0)

    @property
    def fallback_calls(self) -> int:
        """Layer calls sent to sdpa for any reason, decode included."""
        return sum(self.fallbacks.values())

    @property
    def mean_density(self) -> float | None:
        """Mean of :attr:`densities`, or None when none was recorded."""
        return sum(self.densities) / len(self.densities) if self.densities else None

    def count_fallback(self, reason: str) -> None:
        """Count one layer call sent to sdpa.

        Args:
            reason: short reason (a key of :attr:`fallbacks`).
        """
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def reset(self) -> None:
        """Zero every counter (``track_density`` is kept)."""
        self.pipeline_calls = 0
        self.pipeline_tokens = 0
        self.fallbacks.clear()
        self.densities.clear()
