"""Shared helpers of the serving tests (imported as ``conftest``, like the kernel package's)."""

from __future__ import annotations

import torch


def hopper_runs_here() -> bool:
    """Whether the native Hopper kernel can run here: an sm_90 GPU and the library loaded."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    from fpv2.serving.backends import HopperBackend

    return HopperBackend().available()[0]
