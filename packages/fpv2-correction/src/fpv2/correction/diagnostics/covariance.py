"""The within-block covariance error of the mean correction (ALGORITHM.md section 6), row by row.

Notation for packed row ``r`` and key token ``i`` (block ``J``, ``|B_J|`` tokens):
``s_ri = q_r . k_i * scale`` the scaled logit, ``m_r`` the row's maximum logit over
its visible keys, ``w_ri = exp(s_ri - m_r)`` and ``wbar_rJ = mean_{i in J} w_ri``,
``vbar_J = mean_{i in J} v_i``, ``Z_r = sum_{i visible} w_ri`` the dense softmax
denominator, ``sbar_rJ = q_r . kbar_J * scale`` the pooled logit.

A todo block (eligible, not kept) contributes exactly ``N_rJ = sum_i w_ri v_i`` and
``D_rJ = sum_i w_ri = |B_J| wbar_rJ`` to the dense numerator and denominator, and
the correction stands in ``Nhat_rJ = Dhat_rJ vbar_J`` and
``Dhat_rJ = |B_J| exp(sbar_rJ - m_r)``. Splitting the exact numerator,
``N_rJ = D_rJ vbar_J + C_rJ`` with the covariance term

    ``C_rJ = |B_J| * mean_{i in J} (w_ri - wbar_rJ) (v_i - vbar_J)``.

The paper writes it with ``delta_i = s_ri - sbar_rJ``, the logit's deviation
from the pooled logit: to first order ``w_ri - wbar_rJ = exp(sbar_rJ - m_r) *
(delta_i - mean_i delta_i)``, so ``C_rJ`` is ``|B_J| exp(sbar_rJ - m_r) mean_i delta_i
(v_i - vbar_J)`` plus terms of second order in ``delta``; the code evaluates the
exact covariance. The mass surrogate ``Dhat_rJ`` only errs at second order
(Jensen: ``wbar_rJ >= exp(sbar_rJ - m_r)``), so ``C_rJ`` is the leading error term.

With ``Ohat_r`` the corrected output (kept tokens exactly, todo blocks by their
pseudo-keys) and ``O_r`` the dense output, the identity

    ``Ohat_r - O_r = [ -sum_J C_rJ                                   (covariance)
                      + sum_J (Nhat_rJ - D_rJ vbar_J + Ohat_r (D_rJ - Dhat_rJ))  (mass)
                      + Ohat_r D_rU - N_rU ] / Z_r                   (uncorrectable)``

holds exactly, ``U`` being pruned blocks the correction may not add back (not
fully visible to the tile's first row; none when the diagonal band is kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch

from ._checks import check_inputs, check_statistics
from ._walk import TileChunk, walk_tile_chunks
from .segments import segment_coordinates, tile_norms


@dataclass(frozen=True, eq=False)
class CovarianceErrorEstimate:
    """Predicted error of the corrected attention, per row and per tile.

    Row tensors have the ``(total_q, Hq, d)`` layout of the attention output and hold
    the error *corrected minus dense*; their sum is exactly that error (see the module
    docstring). Tile tensors are Frobenius norms over the segment's rows, in segment order.

    Attributes:
        covariance_error: ``-sum_J C_rJ / Z_r``, the first-order prediction.
        mass_error: what the pooled mass surrogate adds (second order in the logit
            spread; it also absorbs the rounding of the stored pooled values).
        uncorrected_error: pruned blocks the correction may not add back, dropped.
        request: ``(S,) long`` request of each segment.
        kv_head: ``(S,) long`` KV head of each segment.
        tile: ``(S,) long`` tile of each segment.
        tile_covariance_error: ``(S,)`` norm of ``covariance_error`` over the tile's rows.
        tile_mass_error: ``(S,)`` norm of ``mass_error`` over the tile's rows.
        tile_uncorrected_error: ``(S,)`` norm of ``uncorrected_error`` over the tile's rows.
    """

    covariance_error: torch.Tensor
    mass_error: torch.Tensor
    uncorrected_error: torch.Tensor
    request: torch.Tensor
    kv_head: torch.Tensor
    tile: torch.Tensor
    tile_covariance_error: torch.Tensor
    tile_mass_error: torch.Tensor
    tile_uncorrected_error: torch.Tensor

    @property
    def predicted_error(self) -> torch.Tensor:
        """The covariance prediction of *corrected minus dense*, ``(total_q, Hq, d)``."""
        return self.covariance_error

    @property
    def total_error(self) -> torch.Tensor:
        """Sum of the three terms: exactly the corrected output minus the dense one, ``(total_q, Hq, d)``."""
        return self.covariance_error + self.mass_error + self.uncorrected_error


def _chunk_errors(
    chunk: TileChunk, statistics: BlockStatistics, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three error terms (covariance, mass, uncorrectable) of every row of one chunk, each ``(R, d)``."""
    w, values = chunk.weights, chunk.values  # (R, nb, Bk), (nb, Bk, d)
    rows, nb, block_size = w.shape
    dtype, device = w.dtype, w.device
    kept, todo = chunk.kept[chunk.row_tile], (~chunk.kept & chunk.eligible)[chunk.row_tile]  # (R, nb)
    uncorrectable = ~kept & ~todo
    stat = slice(chunk.stat_offset, chunk.stat_offset + nb)
    pooled_k = statistics.pooled_k[stat, chunk.kv_head].to(device=device, dtype=dtype)
    pooled_v = statistics.pooled_v[stat, chunk.kv_head].to(device=device, dtype=dtype)
    lengths = statistics.block_lengths[stat].to(device=device, dtype=dtype)

    block_mass = w.sum(dim=2)  # D_rJ
    denom = block_mass.sum(dim=1, keepdim=True)  # Z_r
    flat_v = values.reshape(nb * block_size, -1)

    def numerator(mask: torch.Tensor) -> torch.Tensor:
        """``sum_{i in masked blocks} w_ri v_i``: exact numerator over a set of blocks per row."""
        return (w * mask[:, :, None]).reshape(rows, nb * block_size) @ flat_v

    # Corrected output: kept tokens exactly, todo blocks as pseudo-keys |B_J| exp(sbar - m) with value vbar.
    # Todo blocks are fully visible to every row, so sbar <= max_i s_i <= m_r and the exp cannot overflow.
    pooled_logit = (chunk.queries @ pooled_k.T) * scale - chunk.row_max[:, None]
    surrogate = torch.where(todo, lengths * torch.exp(pooled_logit.masked_fill(~todo, 0.0)), 0.0)  # Dhat_rJ
    kept_mass = (block_mass * kept).sum(dim=1, keepdim=True)
    corrected_num = numerator(kept) + surrogate @ pooled_v
    corrected_den = kept_mass + surrogate.sum(dim=1, keepdim=True)
    corrected = corrected_num / torch.where(corrected_den > 0, corrected_den, torch.ones_like(corrected_den))

    # Covariance: centre w within each todo block (over its real tokens) and v within each block.
    token_todo = todo[:, :, None] & chunk.real[None]  # (R, nb, Bk)
    real_count = chunk.real.sum(dim=1).clamp(min=1).to(dtype)  # (nb,)
    w_mean = (w * token_todo).sum(dim=2) / real_count  # wbar_rJ on todo blocks
    w_centred = torch.where(token_todo, w - w_mean[:, :, None], 0.0)
    v_mean = values.sum(dim=1) / real_count[:, None]  # vbar_J from the tokens, (nb, d)
    v_centred = (values - v_mean[:, None, :]) * chunk.real[:, :, None]
    covariance = w_centred.reshape(rows, nb * block_size) @ v_centred.reshape(nb * block_size, -1)  # sum_J C_rJ

    todo_mass = block_mass * todo
    mass = surrogate @ pooled_v - todo_mass @ v_mean + corrected * (todo_mass - surrogate).sum(dim=1, keepdim=True)
    uncorrectable_mass = (block_mass * uncorrectable).sum(dim=1, keepdim=True)
    dropped = corrected * uncorrectable_mass - numerator(uncorrectable)
    return -covariance / denom, mass / denom, dropped / denom


def covariance_error_estimate(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    index: BlockIndex,
    statistics: BlockStatistics,
    *,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> CovarianceErrorEstimate:
    """Predict the error of the mean-corrected attention from the within-block covariance term.

    For row ``r`` and todo block ``J`` (eligible and not kept, the blocks a
    :class:`~fpv2.kernel.CorrectionPlan` of ``index`` adds back):
    ``C_rJ = |B_J| * mean_{i in J} (w_ri - wbar_rJ) (v_i - vbar_J)`` with
    ``w_ri = exp(s_ri - m_r)``, ``s_ri = q_r . k_i * scale`` and ``m_r`` the row's maximum
    logit over its causally visible keys; ``wbar_rJ`` and ``vbar_J`` are block means.
    In the paper's notation ``delta_i = s_ri - sbar_rJ`` (logit minus pooled logit
    ``sbar_rJ = q_r . kbar_J * scale``) and, to first order in ``delta``,
    ``C_rJ = |B_J| exp(sbar_rJ - m_r) mean_i delta_i (v_i - vbar_J)``; the exact
    covariance is computed here. The predicted output error of row ``r`` is
    ``-sum_J C_rJ / Z_r`` with ``Z_r = sum_{i visible} w_ri`` the row's dense softmax
    denominator (in the same ``m_r`` shift). The surrogate-mass and uncorrectable
    terms that complete the exact error are returned alongside (module docstring).

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        v_cache: ``(num_pages, page_size, Hkv, d)`` paged values.
        batch: the paged prefill batch.
        index: the block index (kept blocks per segment).
        statistics: pooled K and V of ``batch`` with ``index.block_size`` (as the
            correction uses them, see :func:`~fpv2.correction.compute_block_statistics`).
        softmax_scale: logit scale, ``1 / sqrt(d)`` by default.
        compute_dtype: float32 or float64, dtype of the arithmetic and of the results.
        q_descale: ``(B, Hkv) float32`` query descales, required for FP8 inputs.
        k_descale: ``(B, Hkv) float32`` key descales, required for FP8 inputs.
        v_descale: ``(B, Hkv) float32`` value descales, required for FP8 inputs.

    Returns:
        The :class:`CovarianceErrorEstimate` on ``q``'s device.

    Raises:
        TypeError: wrong argument types or dtypes, naming the argument.
        ValueError: inputs, index and statistics that do not describe one batch.
    """
    descales = (q_descale, k_descale, v_descale)
    shapes, scale = check_inputs(
        q, k_cache, v_cache, batch, index, softmax_scale=softmax_scale, compute_dtype=compute_dtype, descales=descales
    )
    check_statistics(statistics, index, batch, shapes.head_dim)
    out_shape = (q.shape[0], shapes.num_q_heads, shapes.head_dim)
    terms = [torch.zeros(out_shape, dtype=compute_dtype, device=q.device) for _ in range(3)]
    for chunk in walk_tile_chunks(
        q,
        k_cache,
        v_cache,
        batch,
        index,
        shapes,
        scale=scale,
        compute_dtype=compute_dtype,
        descales=descales,
        stat_offsets=statistics.block_offsets.cpu().tolist(),
    ):
        for total, part in zip(terms, _chunk_errors(chunk, statistics, scale)):
            total[chunk.out_rows, chunk.out_heads] = part
    request, kv_head, tile = (t.to(q.device) for t in segment_coordinates(index))
    covariance, mass, uncorrected = terms
    return CovarianceErrorEstimate(
        covariance_error=covariance,
        mass_error=mass,
        uncorrected_error=uncorrected,
        request=request,
        kv_head=kv_head,
        tile=tile,
        tile_covariance_error=tile_norms(covariance, batch, index),
        tile_mass_error=tile_norms(mass, batch, index),
        tile_uncorrected_error=tile_norms(uncorrected, batch, index),
    )
