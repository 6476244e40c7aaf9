"""The sparse prefill pipeline: statistics -> block index -> correction plan -> attention."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fpv2.correction import build_correction_plan, compute_block_statistics, compute_key_spread
from fpv2.index import SelectionConfig, available_strategies, get_strategy
from fpv2.index.api import _build_block_index
from fpv2.index.strategies.max_threshold import use_triton_index
from fpv2.kernel import (
    BLOCK_SIZE,
    BlockIndex,
    BlockStatistics,
    CorrectionPlan,
    KeySpread,
    PagedPrefillBatch,
    validate_prefill_inputs,
)

from .backends import AUTO, AttentionBackend, resolve_backend
from .timing import StageClock, StageTimings

if TYPE_CHECKING:
    from fpv2.kernel.triton.tile_repack import TileRepacked

#: The strategy that keeps every causally visible block (the dense mode).
DENSE_STRATEGY = "dense"
#: Logit shifts of the correction's pooled terms: ``log |B_J|`` alone, or with the second-order mass shift
#: (:class:`fpv2.kernel.KeySpread`).
MASS_SHIFTS = ("mean", "second_order")


@dataclass(frozen=True, eq=False)
class PrefillResult:
    """Output of one pipeline call and what produced it.

    Attributes:
        out: ``(total_q, Hq, d)`` attention output.
        index: the block index the attention walked.
        plan: the correction plan, or None when the correction is off.
        statistics: pooled K/V shared by the index and the correction (None when
            neither needed them).
    """

    out: torch.Tensor
    index: BlockIndex
    plan: CorrectionPlan | None
    statistics: BlockStatistics | None = None
    clock: StageClock | None = field(default=None, repr=False)

    @property
    def timings(self) -> StageTimings:
        """Per-stage wall times of this call (reading them synchronises on CUDA, once).

        Returns:
            The :class:`StageTimings`.

        Raises:
            RuntimeError: the result was built without a clock.
        """
        if self.clock is None:
            raise RuntimeError("this PrefillResult carries no timings")
        return self.clock.timings()


class SparsePrefillPipeline:
    """Block-sparse prefill attention over a paged KV cache, stage by stage.

    One call pools K and V per key block once (shared by the index and the
    correction), builds the block index with the selection ``strategy``, builds
    the correction plan (unless ``correction=False``) and runs the attention
    backend.

    Args:
        config: selection parameters (None: :class:`fpv2.index.SelectionConfig` defaults).
        strategy: a name from :func:`fpv2.index.available_strategies`;
            ``"dense"`` keeps every visible block (the dense mode); without the
            correction it runs the backend's own dense mode (``run_dense``, no
            CSR to walk) when the backend has one, and the index is still built
            for the result.
        correction: add the mean correction for pruned blocks.
        mass_shift: the pooled terms' logit shift, ``"mean"`` (``log |B_J|``) or
            ``"second_order"`` (also the block's key spread, one more pass over the keys per
            call; see :mod:`fpv2.kernel.reference.mass_shift`). Backends list what they apply
            in ``mass_shifts``; ``auto`` runs second-order plans where they are applied (the Hopper
            kernel, else the portable one).
        backend: ``"auto"``, a backend name, or a backend object (see
            :func:`fpv2.serving.backends.resolve_backend`).
        check_index: re-check on the device that the index fits the batch (tile offsets,
            causality: two host syncs per call) even when a built-in strategy of
            ``fpv2.index`` built it. By default an index from a built-in strategy is
            recorded as built for the call's batch (:meth:`fpv2.kernel.BlockIndex.assume_compatible`),
            so the kernel makes no host sync for it; indices of third-party strategies
            are always checked.

    Raises:
        TypeError: ``config`` is not a SelectionConfig, or ``correction``/``check_index`` not a bool.
        ValueError: unknown strategy, backend name or mass shift, a second-order shift without the
            correction, or one the backend does not apply.
        RuntimeError: the named backend is not available here.
    """

    def __init__(
        self,
        config: SelectionConfig | None = None,
        *,
        strategy: str = "max_threshold",
        correction: bool = True,
        backend: str | AttentionBackend = AUTO,
        check_index: bool = False,
        mass_shift: str = "mean",
    ) -> None:
        if config is None:
            config = SelectionConfig()
        if not isinstance(config, SelectionConfig):
            raise TypeError(f"config must be a fpv2.index.SelectionConfig; got {type(config).__name__}")
        strategies = list(available_strategies())
        if strategy not in strategies:
            raise ValueError(f"unknown selection strategy {strategy!r}; choose one of: {', '.join(strategies)}")
        if not isinstance(correction, bool):
            raise TypeError(f"correction must be a bool; got {type(correction).__name__}")
        if not isinstance(check_index, bool):
            raise TypeError(f"check_index must be a bool; got {type(check_index).__name__}")
        self.config = config
        self.check_index = check_index
        self.strategy = strategy
        self.correction = correction
        self.backend = resolve_backend(backend)
        if mass_shift not in MASS_SHIFTS:
            raise ValueError(f"mass_shift must be one of {', '.join(MASS_SHIFTS)}; got {mass_shift!r}")
        if mass_shift != "mean":
            if not correction:
                raise ValueError(f"mass_shift={mass_shift!r} shifts the correction's terms: it needs correction=True")
            applied = getattr(self.backend, "mass_shifts", ("mean",))
            if mass_shift not in applied:
                raise ValueError(
                    f"backend {self.backend.name!r} applies mass_shift {', '.join(map(repr, applied))} only; "
                    f"got {mass_shift!r} (the hopper, triton and reference backends apply it, and auto routes to them)"
                )
        self.mass_shift = mass_shift

    def __repr__(self) -> str:
        return (
            f"SparsePrefillPipeline(strategy={self.strategy!r}, correction={self.correction}, "
            f"mass_shift={self.mass_shift!r}, backend={self.backend.name!r}, config={self.config!r})"
        )

    def _tile_copies(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch
    ) -> TileRepacked | None:
        """The backend's empty tile pages for this call, when the Triton pooling can fill them, else None."""
        offer = getattr(self.backend, "tile_copies_for", None)
        if not callable(offer) or self.config.block_size != BLOCK_SIZE or not use_triton_index(q):
            return None
        taker = getattr(self.backend, "primary", self.backend)  # an auto backend offers its primary's pages
        if self.mass_shift not in getattr(taker, "mass_shifts", ("mean",)):
            return None  # the call goes past the backend that would read the pages
        return offer(q, k_cache, v_cache, batch)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        *,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
    ) -> PrefillResult:
        """Run the pipeline on one prefill batch.

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
            v_cache: paged values, same shape as ``k_cache``.
            batch: the batch metadata.
            q_descale: ``(B, Hkv) float32`` FP8 query descales (FP8 inputs only).
            k_descale: FP8 key descales.
            v_descale: FP8 value descales.

        Returns:
            The :class:`PrefillResult` (output, index, plan, timings).

        Raises:
            TypeError, ValueError: invalid inputs (named, with shape and dtype).
        """
        shapes = validate_prefill_inputs(
            q, k_cache, v_cache, batch, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
        )
        clock = StageClock(q.device)
        clock.mark("start")
        values = self.correction or self.strategy != DENSE_STRATEGY
        # A backend that will copy the K/V into tile pages gets the copy from the pooling kernel, which reads
        # every token anyway (one read of the caches and one launch less; Triton pooling only).
        tile_copies = self._tile_copies(q, k_cache, v_cache, batch) if values else None
        # Pooled K serves the index, pooled V the correction: one pass for both. Every strategy gets its
        # statistics here, the dense one too (it reads only their layout): left to build_block_index, they
        # would come from the reference pooling (31 ms and host syncs at 128K on the H200).
        statistics = _pool_statistics(
            q,
            k_cache,
            v_cache,
            batch,
            block_size=self.config.block_size,
            k_descale=k_descale,
            v_descale=v_descale,
            bf16_copies=self.correction,
            values=values,
            tile_copies=tile_copies,
        )
        # The inputs were validated above (with V): build_block_index would check them again.
        index = _build_block_index(
            q,
            k_cache,
            batch,
            config=self.config,
            strategy=self.strategy,
            statistics=statistics,
            q_descale=q_descale,
            k_descale=k_descale,
            inputs_validated=True,
        )
        if index.group != shapes.group or index.num_kv_heads != shapes.num_kv_heads:
            raise ValueError(
                f"strategy {self.strategy!r} built an index for group {index.group} and {index.num_kv_heads} KV "
                f"heads; the inputs have group {shapes.group} and {shapes.num_kv_heads} KV heads"
            )
        if not self.check_index and is_builtin_strategy(self.strategy):
            # Built here from this very batch by a built-in strategy: the kernel need not re-read it.
            index.assume_compatible(batch, shapes.group)
        clock.mark("index")
        plan = None
        if self.correction:
            # A backend that derives the todo bits from the CSR needs no per-segment host work.
            derives_todo = getattr(self.backend, "derives_todo", False)
            spread = _key_spread(k_cache, batch, statistics, k_descale) if self.mass_shift == "second_order" else None
            if derives_todo:
                plan = CorrectionPlan(statistics, key_spread=spread)
            else:
                plan = build_correction_plan(index, statistics, batch, key_spread=spread)
        clock.mark("correction")
        scale = self.config.scale_for(shapes.head_dim)
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        run_dense = getattr(self.backend, "run_dense", None)
        if (
            self.strategy == DENSE_STRATEGY
            and plan is None
            and callable(run_dense)
            and is_builtin_strategy(self.strategy)
        ):
            # Every visible block: the kernel's own dense mode is the same attention without walking a CSR.
            out = run_dense(q, k_cache, v_cache, batch, softmax_scale=scale, **descales)
        else:
            copies = {"tile_copies": tile_copies} if tile_copies is not None else {}
            out = self.backend.run(
                q, k_cache, v_cache, batch, index, plan, softmax_scale=scale, **descales, **copies
            )  # fmt: skip
        clock.mark("attention")
        return PrefillResult(out=out, index=index, plan=plan, statistics=statistics, clock=clock)


def is_builtin_strategy(strategy: str) -> bool:
    """Whether the strategy registered under ``strategy`` now is one of ``fpv2.index``'s own.

    Their indices take the tile offsets from the batch they are built for and keep causal
    blocks only, which the index package's tests check against the reference; a
    third-party strategy (an entry point, or a built-in name registered again) is not
    trusted that way.

    Args:
        strategy: a registered strategy name.

    Returns:
        True for a built-in strategy.
    """
    return type(get_strategy(strategy)).__module__.startswith("fpv2.index.")


def _key_spread(
    k_cache: torch.Tensor, batch: PagedPrefillBatch, statistics: BlockStatistics, k_descale: torch.Tensor | None
) -> KeySpread:
    """The blocks' key spread: one Triton pass on a GPU (no host sync), the PyTorch reference elsewhere."""
    if k_cache.is_cuda:
        from fpv2.kernel.triton.key_spread import key_spread_triton

        return key_spread_triton(k_cache, batch, statistics, k_descale=k_descale)
    return compute_key_spread(k_cache, batch, statistics, k_descale=k_descale)


def _pool_statistics(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    bf16_copies: bool = False,
    values: bool = True,
    tile_copies: TileRepacked | None = None,
    **kw,
):
    """Pooled K/V: the Triton kernel where the Triton index runs, the reference elsewhere.

    Without ``values`` the Triton kernel pools K only (the dense strategy without the correction
    needs no pooled V); the reference pools both either way.

    With ``tile_copies`` (the backend's empty tile pages) the Triton kernel also copies the K/V
    into them. With ``bf16_copies`` (the correction is on) the Triton kernel also writes bf16 copies of the
    pooled K/V, which the Hopper kernel's binding hands over instead of converting the fp32 means
    itself (two conversion kernels and their host time per call); the reference makes none.
    """
    if use_triton_index(q):
        from fpv2.index.triton import pool_blocks_triton  # imports triton: only on the fast path

        copy_dtype = torch.bfloat16 if bf16_copies else None
        return pool_blocks_triton(
            k_cache, v_cache if values else None, batch, pooled_copy_dtype=copy_dtype, tile_copies=tile_copies, **kw
        )
    if tile_copies is not None:
        raise ValueError("tile_copies are written by the Triton pooling kernel; this call pools on the reference")
    return compute_block_statistics(k_cache, v_cache, batch, **kw)
