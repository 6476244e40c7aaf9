"""Diagnostics of a block index and its mean correction, as plain functions over the PyTorch reference.

* :func:`pruned_mass_share`: per tile, the share of the exact softmax mass in pruned blocks;
* :func:`covariance_error_estimate`: the within-block covariance error term of the
  mean correction (ALGORITHM.md section 6), per row and per tile;
* :func:`correction_error_report`: that prediction next to the actual corrected and
  dropped errors against dense attention, per tile.
"""

from .covariance import CovarianceErrorEstimate, covariance_error_estimate
from .mass_share import TileMassShare, pruned_mass_share
from .report import CorrectionErrorReport, correction_error_report
from .segments import pruned_block_counts, segment_coordinates, tile_norms
from .summary import summarize

__all__ = [
    "CorrectionErrorReport",
    "CovarianceErrorEstimate",
    "TileMassShare",
    "correction_error_report",
    "covariance_error_estimate",
    "pruned_block_counts",
    "pruned_mass_share",
    "segment_coordinates",
    "summarize",
    "tile_norms",
]
