"""The spread of each key block around its mean: what the second-order mass shift of the correction reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_contiguous, check_shape, check_tensor


@dataclass(frozen=True, eq=False)
class KeySpread:
    """Per (block, KV head) spread of the keys around their block mean, rows as in :class:`BlockStatistics`.

    A :class:`CorrectionPlan` that carries one asks the kernel for the second-order
    mass shift: every pooled logit gains ``min(scale^2 |q|^2 variance / 2, scale |q|
    radius)`` beside ``log |B_J|`` (see :func:`fpv2.kernel.reference.mass_shift.second_order_shift`).

    Args:
        variance: ``(total_blocks, Hkv) float32``: the mean over the ``d`` dimensions of the
            keys' variance within the block, ``mean_i |k_i - kbar|^2 / d`` over its valid tokens
            (real units: FP8 keys with their descale applied).
        radius: ``(total_blocks, Hkv) float32``: ``max_i |k_i - kbar|`` over the valid tokens.
    """

    variance: torch.Tensor
    radius: torch.Tensor

    def __post_init__(self) -> None:
        variance = check_tensor("variance", self.variance, dtypes=(torch.float32,), ndim=2)
        check_tensor("radius", self.radius, dtypes=(torch.float32,), ndim=2, device=variance.device)
        check_shape("radius", self.radius, tuple(variance.shape))
        check_contiguous("variance", self.variance)
        check_contiguous("radius", self.radius)

    def check_fits(self, pooled_k: torch.Tensor) -> None:
        """Raise ValueError unless the spread has one row per pooled block and KV head of ``pooled_k``.

        Args:
            pooled_k: the statistics' ``(total_blocks, Hkv, d)`` pooled keys.
        """
        if tuple(self.variance.shape) != tuple(pooled_k.shape[:2]) or self.variance.device != pooled_k.device:
            raise ValueError(
                f"key_spread.variance must have shape {tuple(pooled_k.shape[:2])} (total_blocks, Hkv of the "
                f"statistics) on {pooled_k.device}; got shape {tuple(self.variance.shape)} on {self.variance.device}"
            )
