"""Selection strategies: the protocol, the registry and the built-in strategies.

Built-ins, all emitting the same block index with the config's forced blocks
(sink, window, diagonal band) and dense fallbacks:

- ``max_threshold`` (default, the paper's selector): energy ``>= alpha`` times the tile's peak;
- ``top_k``: the ``k`` highest-energy blocks per tile (:class:`TopKStrategy`);
- ``top_p``: the fewest blocks holding a share ``p`` of the tile's energy (:class:`TopPStrategy`);
- ``streaming``: sink and window only, no scoring (:class:`StreamingStrategy`);
- ``vertical_slash``: MInference's vertical-slash pattern (:class:`VerticalSlashStrategy`);
- ``dense``: every visible block.

Registered names hold default instances; pass an instance such as
``TopKStrategy(k=16)`` to use other parameters.
"""

from .base import SelectionStrategy
from .dense import DenseStrategy
from .max_threshold import MaxThresholdStrategy
from .registry import ENTRY_POINT_GROUP, available_strategies, get_strategy, register_strategy, unregister_strategy
from .streaming import StreamingStrategy
from .top_k import TopKStrategy
from .top_p import TopPStrategy
from .vertical_slash import VerticalSlashStrategy

__all__ = [
    "ENTRY_POINT_GROUP",
    "DenseStrategy",
    "MaxThresholdStrategy",
    "SelectionStrategy",
    "StreamingStrategy",
    "TopKStrategy",
    "TopPStrategy",
    "VerticalSlashStrategy",
    "available_strategies",
    "get_strategy",
    "register_strategy",
    "unregister_strategy",
]
