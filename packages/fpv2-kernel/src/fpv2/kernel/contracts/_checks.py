"""Argument checks shared by every contract: one place that words the errors.

Every message names the argument, and the offending shape, dtype or value,
so a caller can tell at once which input is wrong and how.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def describe(t: torch.Tensor) -> str:
    """A short ``shape/dtype/device`` description used in error messages."""
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype],
    ndim: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check type, dtype, rank and (optionally) device of one tensor argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}); got {describe(t)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have rank {ndim}; got {describe(t)}")
    # Callers pass the batch's torch.device: no new device object per check (these run on every call).
    if device is not None and t.device != (device if isinstance(device, torch.device) else torch.device(device)):
        raise ValueError(f"{name} must be on {device} like the other inputs; got {describe(t)}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int | None]) -> None:
    """Check a tensor's shape; ``None`` entries match any size."""
    shape = t.shape
    if len(shape) == len(expected):
        # A plain loop: a generator through all() costs more than the comparisons (this runs on every call).
        for s, e in zip(shape, expected):
            if e is not None and s != e:
                break
        else:
            return
    want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + ")"
    raise ValueError(f"{name} must have shape {want}; got {describe(t)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels load rows as vectors: the innermost dimension must have stride 1."""
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension; got strides {tuple(t.stride())} "
            f"({describe(t)}); call .contiguous() first"
        )


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """Index arrays are read linearly: they must be contiguous."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; got strides {tuple(t.stride())} ({describe(t)})")


def check_positive_int(name: str, value: object, *, power_of_two: bool = False) -> int:
    """Check a positive Python int (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    return value


def first_bad(mask: torch.Tensor) -> int:
    """Index of the first True entry of a 1-D boolean mask (host sync; error paths only)."""
    return int(torch.nonzero(mask.flatten())[0, 0])
