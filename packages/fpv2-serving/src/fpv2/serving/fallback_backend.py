"""A backend that runs a specialised kernel where it serves the call and a portable one elsewhere.

``resolve_backend("auto")`` on an sm_90 GPU returns ``FallbackBackend(hopper,
triton)``: the Hopper kernel serves bf16, the head dims the library is built
for (64, 128 and 256), every page size (TMA or its cp.async gather), caches it
can read as rows, and 128-token blocks; every other call (FP8, other head dims,
head-major caches) runs on the Triton kernel. The choice is a host-side
check of shapes and dtypes, made per call, and recorded in ``last_choice`` so
that benchmarks report which kernel ran. A plan whose mass shift the primary does
not apply (its ``mass_shifts``) runs on the fallback too. A backend named explicitly is never
wrapped: ``backend="hopper"`` refuses what it cannot serve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from fpv2.kernel import BlockIndex, CorrectionPlan, PagedPrefillBatch

if TYPE_CHECKING:
    from fpv2.kernel.triton.tile_repack import TileRepacked


class ServesCheck(Protocol):
    """A backend that can say, before running, whether it serves a call."""

    name: str

    def serves(
        self, q: torch.Tensor, k_cache: torch.Tensor, batch: PagedPrefillBatch, index: BlockIndex | None
    ) -> str | None:
        """None when the backend serves the call, else the reason it does not."""
        ...


class FallbackBackend:
    """``primary`` where :meth:`ServesCheck.serves` accepts the call, ``fallback`` elsewhere.

    Args:
        primary: the specialised backend (it must provide ``serves``).
        fallback: the backend for every other call.
    """

    def __init__(self, primary: ServesCheck, fallback: object) -> None:
        self.primary = primary
        self.fallback = fallback
        self.name = primary.name
        #: Both derive the todo bitmasks themselves, or the pipeline materialises them.
        self.derives_todo = bool(getattr(primary, "derives_todo", False) and getattr(fallback, "derives_todo", False))
        #: ``(backend name, reason or None)`` of the most recent call.
        self.last_choice: tuple[str, str | None] | None = None
        #: Mass shifts either side applies (each plan goes where its shift is applied).
        self.mass_shifts = tuple(
            dict.fromkeys((*getattr(primary, "mass_shifts", ("mean",)), *getattr(fallback, "mass_shifts", ("mean",))))
        )

    def __repr__(self) -> str:
        return f"FallbackBackend(primary={self.primary.name!r}, fallback={self.fallback.name!r})"

    @property
    def last_kv_layout(self) -> str | None:
        """The ``last_kv_layout`` of the backend that served the most recent call (None if it records none)."""
        if self.last_choice is None:
            return None
        chosen = self.primary if self.last_choice[0] == self.primary.name else self.fallback
        return getattr(chosen, "last_kv_layout", None)

    def available(self) -> tuple[bool, str]:
        """Available when the primary is (the fallback is only used per call).

        Returns:
            ``(ok, reason)`` of the primary, with the fallback named.
        """
        ok, why = self.primary.available()
        return ok, f"{why}; calls it does not serve run on {self.fallback.name}"

    def _choose(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        index: BlockIndex | None,
        plan: CorrectionPlan | None = None,
    ):
        shift = plan.mass_shift if plan is not None else "mean"
        if shift not in getattr(self.primary, "mass_shifts", ("mean",)):
            reason = f"the {self.primary.name} kernel does not apply the plan's mass_shift {shift!r}"
        else:
            reason = self.primary.serves(q, k_cache, batch, index)
        chosen = self.primary if reason is None else self.fallback
        self.last_choice = (chosen.name, reason)
        return chosen

    def tile_copies_for(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch
    ) -> TileRepacked | None:
        """The primary's empty tile pages for the call, if it has such a method and will run the call on them.

        Returns:
            The primary's ``tile_copies_for(...)`` result, or None.
        """
        offer = getattr(self.primary, "tile_copies_for", None)
        return offer(q, k_cache, v_cache, batch) if callable(offer) else None

    def carries_tile_pages(
        self, q: torch.Tensor, k_cache: torch.Tensor, batch: PagedPrefillBatch, copy_bytes: int
    ) -> bool:
        """The primary's ``carries_tile_pages(...)``, or False when it has none.

        Returns:
            Whether a chunked prefill should keep tile pages for the primary (:meth:`run` hands them to
            it only; a call that falls back reads the caches).
        """
        carries = getattr(self.primary, "carries_tile_pages", None)
        return bool(carries(q, k_cache, batch, copy_bytes)) if callable(carries) else False

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        index: BlockIndex,
        plan: CorrectionPlan | None,
        **kwargs: object,
    ) -> torch.Tensor:
        """Run the call on the primary if it serves it, else on the fallback.

        Arguments as for :meth:`fpv2.serving.backends.AttentionBackend.run`; ``tile_copies`` (from
        :meth:`tile_copies_for`) goes to the primary only.

        Returns:
            ``(total_q, Hq, d)`` output.
        """
        backend = self._choose(q, k_cache, batch, index, plan)
        if backend is not self.primary:
            kwargs.pop("tile_copies", None)  # made for the primary: the fallback reads the caches
        return backend.run(q, k_cache, v_cache, batch, index, plan, **kwargs)

    def run_dense(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        **kwargs: torch.Tensor | float | None,
    ) -> torch.Tensor:
        """Dense causal attention on whichever backend serves it (both offer ``run_dense``).

        Arguments as for :meth:`fpv2.serving.backends.AttentionBackend.run`, without index and plan.

        Returns:
            ``(total_q, Hq, d)`` output.
        """
        backend = self._choose(q, k_cache, batch, None)
        return backend.run_dense(q, k_cache, v_cache, batch, **kwargs)
