"""Fused Triton index stage: paged block pooling, single-pass scoring + selection, CSR compaction.

The fast path of the ``max_threshold`` strategy on CUDA (and, under
``TRITON_INTERPRET=1``, on the CPU for tests). Same semantics as the PyTorch
reference in :mod:`fpv2.index.reference`; see :func:`select_blocks_triton` for
the host-sync behaviour, :class:`IndexWorkspace` for the scratch bound,
:mod:`fpv2.kernel.triton.relaunch` for how kernels are relaunched cheaply and
:class:`GraphedIndex` for replaying the whole stage as a CUDA graph.
"""

from .api import interpreter_enabled, pool_blocks_triton, select_blocks_triton
from .graphed import GraphedIndex
from .workspace import CHUNK_BLOCKS, IndexWorkspace

__all__ = [
    "CHUNK_BLOCKS",
    "GraphedIndex",
    "IndexWorkspace",
    "interpreter_enabled",
    "pool_blocks_triton",
    "select_blocks_triton",
]
