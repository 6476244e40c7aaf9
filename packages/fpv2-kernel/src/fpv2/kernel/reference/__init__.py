"""The PyTorch reference: the readable definition of every kernel's semantics, on CPU or GPU.

* :func:`dense_attention`: causal attention of a varlen batch over a paged cache;
* :func:`sparse_attention`: attention over the kept blocks of a CSR block index,
  with the optional mean correction for pruned blocks;
* :func:`expand_block_mask`: the token-level mask an index stands for;
* :func:`second_order_shift`: the correction's optional second-order mass shift;
* pooling, paged gather, PackGQA packing and the correction rule they build on;
* the FP8 (e4m3) quantisation conventions of the kernels.
"""

from .attention import dense_attention
from .correction_rule import todo_blocks, todo_words
from .fp8 import (
    FP8_E4M3_MAX,
    dequantize_cache,
    dequantize_queries,
    quantize_cache,
    quantize_probabilities,
    quantize_queries,
)
from .mass_shift import second_order_shift
from .packgqa import pack_queries
from .paged import gather_kv
from .pooling import pool_blocks, pool_request
from .sparse import expand_block_mask, sparse_attention

__all__ = [
    "FP8_E4M3_MAX",
    "dense_attention",
    "dequantize_cache",
    "dequantize_queries",
    "expand_block_mask",
    "gather_kv",
    "pack_queries",
    "pool_blocks",
    "pool_request",
    "quantize_cache",
    "quantize_probabilities",
    "quantize_queries",
    "second_order_shift",
    "sparse_attention",
    "todo_blocks",
    "todo_words",
]
