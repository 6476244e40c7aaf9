"""PyTorch reference of the index stage: tile geometry, scoring, forced blocks, selection.

Readable and exact rather than fast; the fused kernels are tested against it.
"""

from .csr import assemble_block_index, leading_blocks_index
from .forced import (
    dense_tile_count,
    dense_tile_mask,
    forced_block_mask,
    forced_blocks,
    is_dense_tile,
    visible_block_mask,
)
from .inputs import SelectionShapes, check_selection_inputs, check_statistics
from .scoring import LOG2E, TileEnergies, block_energies, block_energies_online, block_logits, contribution_mask
from .selection import request_keep_mask, select_blocks, threshold_mask
from .tiles import NO_ROW, RequestTiles, request_tiles, tile_rows

__all__ = [
    "LOG2E",
    "NO_ROW",
    "RequestTiles",
    "SelectionShapes",
    "TileEnergies",
    "assemble_block_index",
    "block_energies",
    "block_energies_online",
    "block_logits",
    "check_selection_inputs",
    "check_statistics",
    "contribution_mask",
    "dense_tile_count",
    "dense_tile_mask",
    "forced_block_mask",
    "forced_blocks",
    "is_dense_tile",
    "leading_blocks_index",
    "request_keep_mask",
    "request_tiles",
    "select_blocks",
    "threshold_mask",
    "tile_rows",
    "visible_block_mask",
]
