"""Summary statistics of a per-tile diagnostic: mean, median, 95th percentile and maximum."""

from __future__ import annotations

import math

import torch


def summarize(values: torch.Tensor) -> dict[str, float]:
    """``mean``, ``p50``, ``p95`` and ``max`` of a 1-D tensor (NaN for each when it is empty).

    Percentiles interpolate linearly between order statistics (``torch.quantile``).

    Args:
        values: ``(n,)`` floating tensor.

    Returns:
        A dict with keys ``mean``, ``p50``, ``p95``, ``max``.

    Raises:
        TypeError: ``values`` is not a floating tensor.
        ValueError: ``values`` is not 1-D.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"values must be a floating torch.Tensor, got {type(values).__name__}")
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D; got shape {tuple(values.shape)}, dtype {values.dtype}")
    if values.numel() == 0:
        return dict.fromkeys(("mean", "p50", "p95", "max"), math.nan)
    x = values.detach().double()
    quantiles = torch.quantile(x, torch.tensor([0.5, 0.95], dtype=x.dtype, device=x.device))
    return {"mean": float(x.mean()), "p50": float(quantiles[0]), "p95": float(quantiles[1]), "max": float(x.max())}
