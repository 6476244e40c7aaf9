"""The second-order mass shift of a pooled correction term: how much more mass a block holds than its mean says.

The mean correction weighs a pruned block ``J`` by ``|B_J| exp(s_bar)``, with
``s_bar = q . kbar_J * scale``. Its true softmax mass, ``sum_i exp(q . k_i * scale)``,
is at least that (Jensen's inequality): larger by the mean of ``exp(delta_i)`` over the
block's score deviations. The second-order (cumulant) expansion of that factor is
``exp(var(delta) / 2)``, and with keys spread evenly over the ``d`` dimensions
(variance ``sigma2_J`` per dimension) ``var(delta) = scale^2 |q|^2 sigma2_J``. The
block's radius ``rho_J`` caps the shift at the largest mass the block can hold,
``|B_J| exp(s_bar + scale |q| rho_J)``, so the shifted term stays between two bounds
that hold for any keys.
"""

from __future__ import annotations

import torch


def second_order_shift(rows: torch.Tensor, variance: torch.Tensor, radius: torch.Tensor, scale: float) -> torch.Tensor:
    """The logit shift ``min(scale^2 |q|^2 variance / 2, scale |q| radius)`` of each (row, pooled block) pair.

    Args:
        rows: ``(R, d)`` query rows in real units (FP8 queries with their descale applied).
        variance: ``(n,)`` per-dimension key variance of each pooled block.
        radius: ``(n,)`` radius of each pooled block.
        scale: the softmax scale.

    Returns:
        ``(R, n)`` shifts in natural-log units, in the dtype of ``rows``: added to the pooled
        logits beside ``log |B_J|``.
    """
    norm2 = rows.pow(2).sum(dim=1, keepdim=True)  # (R, 1)
    variance = variance.to(device=rows.device, dtype=rows.dtype)[None, :]
    radius = radius.to(device=rows.device, dtype=rows.dtype)[None, :]
    return torch.minimum(0.5 * scale * scale * norm2 * variance, scale * norm2.sqrt() * radius)
