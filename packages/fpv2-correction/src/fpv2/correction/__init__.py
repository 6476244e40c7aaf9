"""fpv2.correction: the zero-order mean correction for pruned key blocks.

Pools key/value blocks into :class:`fpv2.kernel.BlockStatistics`, turns a block
index into a :class:`fpv2.kernel.CorrectionPlan` (per-segment todo bitmasks),
and names the corrected reference attention.
"""

from fpv2.kernel._compat import check_siblings as _check_siblings

from ._version import __version__
from .diagnostics import (
    CorrectionErrorReport,
    CovarianceErrorEstimate,
    TileMassShare,
    correction_error_report,
    covariance_error_estimate,
    pruned_mass_share,
)
from .key_spread import KeySpread, compute_key_spread, second_order_shift
from .plan import build_correction_plan
from .reference import corrected_attention
from .statistics import compute_block_statistics

_check_siblings("fpv2-correction")

__all__ = [
    "CorrectionErrorReport",
    "CovarianceErrorEstimate",
    "KeySpread",
    "TileMassShare",
    "__version__",
    "build_correction_plan",
    "compute_block_statistics",
    "compute_key_spread",
    "corrected_attention",
    "correction_error_report",
    "covariance_error_estimate",
    "pruned_mass_share",
    "second_order_shift",
]
