"""Starting the Hopper backend's tile repack early, on a side stream, while the index is built.

The repack (:mod:`fpv2.serving.tile_repack_policy`) needs only the call's K/V
and batch, not the block index, yet it ran in front of the attention kernel:
0.34 ms at 128K on the H200, after an index stage whose scoring pass is
compute-bound. :func:`stage_tile_repack` issues the copy on a side stream as
soon as the pipeline has issued its pooling launch; the side stream first waits
for everything already on the caller's stream (the K/V writes, the pooling), so
the copy runs beside the scoring pass. :meth:`StagedTileRepack.claim` hands the
copies to the attention call that uses the same caches and batch, after making
the caller's stream wait for the copy (no host synchronisation anywhere).

Without CUDA (the CPU tests) or while a CUDA graph is being captured, the copy
runs on the caller's stream: the same tensors, in the same order as the
inline path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fpv2.kernel import PagedPrefillBatch

if TYPE_CHECKING:  # the copy imports triton: only when a copy is made
    from fpv2.kernel.triton.tile_repack import TileRepacked


@dataclass(frozen=True)
class StagedTileRepack:
    """A tile repack issued ahead of its attention call.

    Attributes:
        k_cache: the source keys (kept so the source cannot be freed and its address reused while staged).
        v_cache: the source values.
        batch: the source batch.
        repacked: the :class:`~fpv2.kernel.triton.tile_repack.TileRepacked` copies.
        ready: the event recorded on the side stream after the copy, or None when it ran on the caller's stream.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    batch: PagedPrefillBatch
    repacked: TileRepacked
    ready: torch.cuda.Event | None

    @property
    def on_side_stream(self) -> bool:
        """Whether the copy was issued on a side stream (False: on the caller's stream)."""
        return self.ready is not None

    def matches(self, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch) -> bool:
        """Whether an attention call on these caches and batch is the one this copy was made for."""
        return k_cache is self.k_cache and v_cache is self.v_cache and batch is self.batch

    def claim(self) -> TileRepacked:
        """The copies, after making the current stream wait for them.

        Returns:
            The :class:`~fpv2.kernel.triton.tile_repack.TileRepacked` copies.
        """
        if self.ready is not None:
            torch.cuda.current_stream(self.k_cache.device).wait_event(self.ready)
        return self.repacked


def stage_tile_repack(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    side_stream: torch.cuda.Stream | None,
) -> StagedTileRepack:
    """Issue :func:`~fpv2.kernel.triton.tile_repack.repack_to_tile_pages` on ``side_stream``.

    Args:
        k_cache: the call's paged keys.
        v_cache: the call's paged values.
        batch: the call's batch.
        side_stream: the stream to copy on; None (or a CUDA graph being captured) copies on the
            current stream.

    Returns:
        The :class:`StagedTileRepack`; :meth:`StagedTileRepack.claim` before using its tensors.
    """
    from fpv2.kernel.triton.tile_repack import repack_to_tile_pages

    if side_stream is None or not k_cache.is_cuda or torch.cuda.is_current_stream_capturing():
        return StagedTileRepack(k_cache, v_cache, batch, repack_to_tile_pages(k_cache, v_cache, batch), None)
    caller = torch.cuda.current_stream(k_cache.device)
    side_stream.wait_stream(caller)
    with torch.cuda.stream(side_stream):
        repacked = repack_to_tile_pages(k_cache, v_cache, batch)
        ready = torch.cuda.Event()
        ready.record(side_stream)
    # Allocated on the side stream, read and freed on the caller's: the allocator must not hand the memory out
    # again before the caller's stream is done with it.
    for tensor in (repacked.k_cache, repacked.v_cache, repacked.batch.page_table):
        tensor.record_stream(caller)
    return StagedTileRepack(k_cache, v_cache, batch, repacked, ready)
