"""The correction plan: which pruned blocks each tile adds back, as materialised todo bitmasks.

For segment ``s`` = (request, KV head, tile) in the block index's segment
order, the eligible range is ``J < (prefix + p_first) // Bk`` (blocks fully
visible to the tile's first row); a block is *todo* when it is eligible and not
kept. The bits follow :func:`fpv2.kernel.reference.correction_rule.todo_words`:
one signed 64-bit word per chunk of 64 eligible blocks, bit ``i`` of word ``w``
for block ``64 * w + i``. Kernels can derive the same bits from the index; the
materialised form makes the plan explicit, testable and cheap to inspect.
"""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import (
    BlockIndex,
    BlockStatistics,
    CorrectionPlan,
    KeySpread,
    PagedPrefillBatch,
    num_key_blocks,
    num_query_tiles,
    tile_span,
)
from fpv2.kernel.reference.correction_rule import todo_words


def _check_statistics(statistics: BlockStatistics, index: BlockIndex, batch: PagedPrefillBatch) -> None:
    """The statistics must pool this batch with the index's block size and head count."""
    if not isinstance(statistics, BlockStatistics):
        raise TypeError(f"statistics must be a BlockStatistics, got {type(statistics).__name__}")
    if statistics.block_size != index.block_size:
        raise ValueError(
            f"statistics.block_size={statistics.block_size} differs from the block index's "
            f"block_size={index.block_size}; pool the statistics with the index's block size"
        )
    if statistics.pooled_v is None:
        raise ValueError("the correction needs pooled values: statistics.pooled_v is None (pool K and V)")
    if statistics.num_kv_heads != index.num_kv_heads:
        raise ValueError(
            f"statistics have Hkv={statistics.num_kv_heads} (pooled_k shape {tuple(statistics.pooled_k.shape)}), "
            f"the block index has num_kv_heads={index.num_kv_heads}"
        )
    expected = [0]
    for kv_len in batch.host.seqlens_k:
        expected.append(expected[-1] + num_key_blocks(kv_len, index.block_size))
    got = statistics.block_offsets.cpu().tolist()
    if got != expected:
        raise ValueError(
            f"statistics.block_offsets {got[:8]} do not match the batch's blocks per request {expected[:8]} "
            f"(seqlens_k {batch.host.seqlens_k[:8]}, block_size {index.block_size})"
        )


def build_correction_plan(
    index: BlockIndex,
    statistics: BlockStatistics,
    batch: PagedPrefillBatch,
    *,
    key_spread: KeySpread | None = None,
) -> CorrectionPlan:
    """Materialise the todo bitmask of every segment of ``index``.

    Args:
        index: the block index (checked against ``batch`` with its own group).
        statistics: pooled K and V of ``batch`` with ``index.block_size``.
        batch: the paged prefill batch the index was built for.
        key_spread: the blocks' key spread, to ask the kernel for the second-order mass shift
            (:func:`~fpv2.correction.compute_key_spread`); None for the mean correction.

    Returns:
        A :class:`~fpv2.kernel.CorrectionPlan` with ``todo_offsets (S+1,) int32`` and
        ``todo_masks (W,) int64`` on the statistics' device.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: the index, statistics and batch do not fit together (block size,
            heads, blocks per request, tiles), naming what differs.
    """
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index must be a BlockIndex, got {type(index).__name__}")
    if not isinstance(batch, PagedPrefillBatch):
        raise TypeError(f"batch must be a PagedPrefillBatch, got {type(batch).__name__}")
    index.check_compatible(batch, index.group)
    _check_statistics(statistics, index, batch)
    offsets = index.offsets.cpu().tolist()
    blocks = index.blocks.cpu().tolist()
    host = batch.host
    word_offsets, words = [0], []
    segment = 0
    for q_len, prefix in zip(host.q_lens, host.prefix):
        ntiles = num_query_tiles(q_len, index.group, index.tile_size)
        spans = [
            tile_span(t, q_len, prefix, index.group, tile_size=index.tile_size, block_size=index.block_size)
            for t in range(ntiles)
        ]
        for _ in range(index.num_kv_heads):  # segment order: request, KV head, tile
            for span in spans:
                words.extend(todo_words(blocks[offsets[segment] : offsets[segment + 1]], span))
                word_offsets.append(len(words))
                segment += 1
    device = statistics.pooled_k.device
    return CorrectionPlan(
        statistics=statistics,
        todo_offsets=torch.tensor(word_offsets, dtype=torch.int32, device=device),
        todo_masks=torch.tensor(words, dtype=torch.int64, device=device),
        key_spread=key_spread,
    )
