"""Data contracts shared by every fpv2 component (mirrored by the C ABI structs)."""

from .block_index import SEGMENT_ORDER, BlockIndex, expected_tile_offsets
from .correction_plan import CORRECTION_CHUNK, BlockStatistics, CorrectionPlan
from .geometry import BLOCK_SIZE, TILE_SIZE, TileSpan, cdiv, num_key_blocks, num_query_tiles, tile_span
from .key_spread import KeySpread
from .paged_batch import HostBatchView, PagedPrefillBatch
from .prefill_inputs import ACTIVATION_DTYPES, SUPPORTED_HEAD_DIMS, PrefillShapes, validate_prefill_inputs

__all__ = [
    "ACTIVATION_DTYPES",
    "BLOCK_SIZE",
    "CORRECTION_CHUNK",
    "SEGMENT_ORDER",
    "SUPPORTED_HEAD_DIMS",
    "TILE_SIZE",
    "BlockIndex",
    "BlockStatistics",
    "CorrectionPlan",
    "HostBatchView",
    "KeySpread",
    "PagedPrefillBatch",
    "PrefillShapes",
    "TileSpan",
    "cdiv",
    "expected_tile_offsets",
    "num_key_blocks",
    "num_query_tiles",
    "tile_span",
    "validate_prefill_inputs",
]
