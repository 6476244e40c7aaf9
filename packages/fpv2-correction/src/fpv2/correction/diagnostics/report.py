"""Predicted versus actual error of the mean correction, per tile, next to the error of dropping."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, CorrectionPlan, PagedPrefillBatch
from fpv2.kernel.reference.attention import dense_attention

from ..plan import build_correction_plan
from ..reference import corrected_attention
from .covariance import covariance_error_estimate
from .segments import pruned_block_counts, tile_norms
from .summary import summarize


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean of their positions), as float64."""
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(x.numel(), dtype=torch.float64, device=x.device)
    values, inverse = torch.unique(x, return_inverse=True)
    sums = torch.zeros(values.numel(), dtype=torch.float64, device=x.device).index_add_(0, inverse, ranks)
    counts = torch.bincount(inverse, minlength=values.numel()).to(torch.float64)
    return (sums / counts)[inverse]


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors (NaN when either is constant or has fewer than 2 entries)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = x.norm() * y.norm()
    return float((x * y).sum() / denom) if x.numel() > 1 and float(denom) > 0 else float("nan")


@dataclass(frozen=True, eq=False)
class CorrectionErrorReport:
    """Per-tile errors against dense attention, in the block index's segment order.

    Every error is a Frobenius norm over the tile's PackGQA rows and all ``d``
    columns of the output (absolute, in output units); divide by ``dense_norm``
    for relative figures (see :meth:`relative`).

    Attributes:
        request: ``(S,) long`` request of each segment.
        kv_head: ``(S,) long`` KV head of each segment.
        tile: ``(S,) long`` tile of each segment.
        predicted_error: norm of the covariance prediction of the corrected error.
        mass_error: norm of the surrogate-mass term of the corrected error.
        uncorrected_error: norm of the term of pruned blocks the correction cannot add back.
        corrected_error: norm of ``corrected_attention - dense_attention``.
        dropped_error: norm of ``sparse attention without correction - dense_attention``.
        dense_norm: norm of the dense output.
        num_pruned_blocks: ``(S,) long`` causally visible blocks the segment does not keep.
    """

    request: torch.Tensor
    kv_head: torch.Tensor
    tile: torch.Tensor
    predicted_error: torch.Tensor
    mass_error: torch.Tensor
    uncorrected_error: torch.Tensor
    corrected_error: torch.Tensor
    dropped_error: torch.Tensor
    dense_norm: torch.Tensor
    num_pruned_blocks: torch.Tensor

    def relative(self, field: str) -> torch.Tensor:
        """A per-tile error divided by the tile's dense output norm (0 where that norm is 0).

        Args:
            field: ``predicted_error``, ``mass_error``, ``uncorrected_error``,
                ``corrected_error`` or ``dropped_error``.

        Returns:
            ``(S,)`` relative errors.

        Raises:
            ValueError: unknown ``field``.
        """
        fields = ("predicted_error", "mass_error", "uncorrected_error", "corrected_error", "dropped_error")
        if field not in fields:
            raise ValueError(f"field must be one of {fields}; got {field!r}")
        norm = self.dense_norm
        return getattr(self, field) / torch.where(norm > 0, norm, torch.ones_like(norm))

    def correlation(self) -> dict[str, float]:
        """Pearson and Spearman correlation across tiles of the predicted and the actual corrected error.

        Returns:
            ``{"pearson": ..., "spearman": ...}`` (NaN when there are fewer than two
            tiles or one side is constant).
        """
        x, y = self.predicted_error, self.corrected_error
        if x.numel() < 2:
            return {"pearson": float("nan"), "spearman": float("nan")}
        return {"pearson": _pearson(x, y), "spearman": _pearson(_ranks(x), _ranks(y))}

    def improved_fraction(self) -> float:
        """Share of tiles with pruned blocks whose corrected error is below the dropped error.

        Returns:
            The fraction in [0, 1], NaN when no tile prunes anything.
        """
        lossy = self.num_pruned_blocks > 0
        if not bool(lossy.any()):
            return float("nan")
        return float((self.corrected_error[lossy] < self.dropped_error[lossy]).double().mean())

    def summary(self) -> dict[str, dict[str, float]]:
        """``mean/p50/p95/max`` over tiles of the relative predicted, corrected and dropped errors.

        Returns:
            ``{"predicted": {...}, "corrected": {...}, "dropped": {...}}``.
        """
        return {name: summarize(self.relative(f"{name}_error")) for name in ("predicted", "corrected", "dropped")}


def correction_error_report(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    index: BlockIndex,
    statistics: BlockStatistics,
    *,
    plan: CorrectionPlan | None = None,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> CorrectionErrorReport:
    """Compare, per tile, the predicted correction error with the actual corrected and dropped errors.

    Runs the PyTorch references: :func:`~fpv2.kernel.reference.dense_attention`,
    :func:`~fpv2.kernel.reference.sparse_attention` without a plan (pruned blocks
    dropped), :func:`~fpv2.correction.corrected_attention` with ``plan``, and
    :func:`covariance_error_estimate`, all in ``compute_dtype``.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        v_cache: ``(num_pages, page_size, Hkv, d)`` paged values.
        batch: the paged prefill batch.
        index: the block index.
        statistics: pooled K and V with ``index.block_size``.
        plan: the correction plan to apply; built from ``index`` and ``statistics`` when None.
        softmax_scale: logit scale, ``1 / sqrt(d)`` by default.
        compute_dtype: float32 or float64.
        q_descale: ``(B, Hkv) float32`` query descales, required for FP8 inputs.
        k_descale: ``(B, Hkv) float32`` key descales, required for FP8 inputs.
        v_descale: ``(B, Hkv) float32`` value descales, required for FP8 inputs.

    Returns:
        The per-tile :class:`CorrectionErrorReport` on ``q``'s device.

    Raises:
        TypeError: wrong argument types or dtypes, naming the argument.
        ValueError: inputs, index, statistics and plan that do not describe one batch.
    """
    # Imported here, like corrected_attention does: older kernel wheels lack the sparse reference.
    from fpv2.kernel.reference.sparse import sparse_attention

    options = {
        "softmax_scale": softmax_scale,
        "compute_dtype": compute_dtype,
        "q_descale": q_descale,
        "k_descale": k_descale,
        "v_descale": v_descale,
    }
    estimate = covariance_error_estimate(q, k_cache, v_cache, batch, index, statistics, **options)
    if plan is None:
        plan = build_correction_plan(index, statistics, batch)
    dense = dense_attention(q, k_cache, v_cache, batch, **options)
    dropped = sparse_attention(q, k_cache, v_cache, batch, index, **options)
    corrected = corrected_attention(q, k_cache, v_cache, batch, index, plan, **options)
    return CorrectionErrorReport(
        request=estimate.request,
        kv_head=estimate.kv_head,
        tile=estimate.tile,
        predicted_error=estimate.tile_covariance_error,
        mass_error=estimate.tile_mass_error,
        uncorrected_error=estimate.tile_uncorrected_error,
        corrected_error=tile_norms(corrected - dense, batch, index),
        dropped_error=tile_norms(dropped - dense, batch, index),
        dense_norm=tile_norms(dense, batch, index),
        num_pruned_blocks=pruned_block_counts(index, batch).to(q.device),
    )
