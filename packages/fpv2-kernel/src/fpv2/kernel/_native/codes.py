"""Numeric constants of the C ABI (``include/fpv2/fpv2.h``), mirrored once for Python.

The tests parse the header and compare every value here against it.
"""

from __future__ import annotations

import enum

#: Highest tensor rank an ``fpv2_tensor_t`` describes (``FPV2_MAX_NDIM``).
MAX_NDIM = 4
#: ``FPV2_PREFILL_CAUSAL``: the causal flag every prefill call must set.
PREFILL_CAUSAL = 1
#: ``FPV2_KERNEL_TILE_SIZE``: packed query rows per tile of the Hopper kernel.
KERNEL_TILE_SIZE = 128
#: ``FPV2_CORRECTION_CHUNK``: pooled blocks per correction step (one 64-bit todo word).
CORRECTION_CHUNK = 64


class Status(enum.IntEnum):
    """``fpv2_status_t``: what every status-returning ``fpv2_`` function returns."""

    OK = 0
    INVALID_ARGUMENT = 1
    UNSUPPORTED = 2
    NOT_BUILT = 3
    CUDA = 4
    WORKSPACE_TOO_SMALL = 5
    INTERNAL = 6


class DType(enum.IntEnum):
    """``fpv2_dtype_t``: element type codes of ``fpv2_tensor_t``."""

    INVALID = 0
    F16 = 1
    BF16 = 2
    F32 = 3
    E4M3 = 4
    I32 = 5
    I64 = 6
