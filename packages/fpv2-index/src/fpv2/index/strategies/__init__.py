"""Selection strategies: the protocol, the registry and the built-in strategies.

Built-ins: ``max_threshold`` (default, the paper's selector) and ``dense``.
"""

from .base import SelectionStrategy
from .dense import DenseStrategy
from .max_threshold import MaxThresholdStrategy
from .registry import ENTRY_POINT_GROUP, available_strategies, get_strategy, register_strategy, unregister_strategy

__all__ = [
    "ENTRY_POINT_GROUP",
    "DenseStrategy",
    "MaxThresholdStrategy",
    "SelectionStrategy",
    "available_strategies",
    "get_strategy",
    "register_strategy",
    "unregister_strategy",
]
