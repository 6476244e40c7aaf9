"""fpv2.kernel: prefill attention kernels, their data contracts and the PyTorch reference.

An engine can depend on this wheel alone: it brings the contracts (paged batch,
block index, correction plan), the kernels and the readable reference.
"""

from ._compat import check_siblings as _check_siblings
from ._version import __version__
from .contracts import (
    BLOCK_SIZE,
    CORRECTION_CHUNK,
    TILE_SIZE,
    BlockIndex,
    BlockStatistics,
    CorrectionPlan,
    KeySpread,
    PagedPrefillBatch,
    PrefillShapes,
    validate_prefill_inputs,
)

_check_siblings("fpv2-kernel")

__all__ = [
    "BLOCK_SIZE",
    "CORRECTION_CHUNK",
    "TILE_SIZE",
    "BlockIndex",
    "BlockStatistics",
    "CorrectionPlan",
    "KeySpread",
    "PagedPrefillBatch",
    "PrefillShapes",
    "__version__",
    "validate_prefill_inputs",
]
