"""fpv2.index: the index stage of block-sparse prefill attention.

Pools key blocks, scores them per PackGQA query tile, and emits the CSR
:class:`fpv2.kernel.BlockIndex` every kernel reads. Selection strategies are
swappable (see :mod:`fpv2.index.strategies`); ``max_threshold`` is the default.
"""

from fpv2.kernel._compat import check_siblings as _check_siblings

from ._version import __version__
from .api import build_block_index
from .config import SelectionConfig
from .strategies import (
    ENTRY_POINT_GROUP,
    DenseStrategy,
    MaxThresholdStrategy,
    SelectionStrategy,
    available_strategies,
    get_strategy,
    register_strategy,
    unregister_strategy,
)

_check_siblings("fpv2-index")

__all__ = [
    "ENTRY_POINT_GROUP",
    "DenseStrategy",
    "MaxThresholdStrategy",
    "SelectionConfig",
    "SelectionStrategy",
    "__version__",
    "available_strategies",
    "build_block_index",
    "get_strategy",
    "register_strategy",
    "unregister_strategy",
]
