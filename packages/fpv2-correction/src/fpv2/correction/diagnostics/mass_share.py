"""Pruned softmax mass per tile: how much of the exact attention a block index leaves out.

For packed row ``r`` with scaled logits ``s_ri`` over its causally visible keys
``i``, the exact softmax mass of key block ``J`` is
``share_rJ = sum_{i in J, visible} exp(s_ri) / sum_{i visible} exp(s_ri)``.
A tile's *pruned share* of row ``r`` is the sum of ``share_rJ`` over the blocks
its segment does not keep. This is what dropping pruned blocks loses, and what
the mean correction has to stand in for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fpv2.kernel.contracts import BlockIndex, PagedPrefillBatch

from ._checks import check_inputs
from ._walk import walk_tile_chunks
from .segments import segment_coordinates
from .summary import summarize

_FIELDS = ("share_mean", "share_max", "uncorrectable_share_mean", "max_pruned_block_share", "max_block_share")


@dataclass(frozen=True, eq=False)
class TileMassShare:
    """Per-segment pruned softmax mass of a block index, aligned with the index's segment order.

    Attributes:
        request: ``(S,) long`` request of each segment.
        kv_head: ``(S,) long`` KV head of each segment.
        tile: ``(S,) long`` tile of each segment.
        share_mean: ``(S,)`` mean over the tile's rows of the share of the row's exact
            softmax mass that falls in pruned (not kept) blocks.
        share_max: ``(S,)`` maximum of that share over the tile's rows.
        uncorrectable_share_mean: ``(S,)`` the part of ``share_mean`` in pruned blocks the
            correction cannot add back (not fully visible to the tile's first row). Zero
            for any index that keeps the diagonal band.
        max_pruned_block_share: ``(S,)`` largest tile-mean mass share of a single pruned
            block (0 when nothing is pruned).
        max_block_share: ``(S,)`` largest tile-mean mass share of any single block.
    """

    request: torch.Tensor
    kv_head: torch.Tensor
    tile: torch.Tensor
    share_mean: torch.Tensor
    share_max: torch.Tensor
    uncorrectable_share_mean: torch.Tensor
    max_pruned_block_share: torch.Tensor
    max_block_share: torch.Tensor

    @property
    def num_segments(self) -> int:
        """Number of segments ``S``."""
        return self.share_mean.numel()

    def summary(self, field: str = "share_mean") -> dict[str, float]:
        """``mean``, ``p50``, ``p95`` and ``max`` over segments of one per-segment field.

        Args:
            field: one of ``share_mean``, ``share_max``, ``uncorrectable_share_mean``,
                ``max_pruned_block_share``, ``max_block_share``.

        Returns:
            The summary dict (NaN values for an index without segments).

        Raises:
            ValueError: unknown ``field``.
        """
        if field not in _FIELDS:
            raise ValueError(f"field must be one of {_FIELDS}; got {field!r}")
        return summarize(getattr(self, field))


def _tile_mean(x: torch.Tensor, row_tile: torch.Tensor, ntiles: int) -> torch.Tensor:
    """Mean over each tile's rows of per-row values ``x (R, ...)``; every tile has at least one row."""
    total = torch.zeros(ntiles, *x.shape[1:], dtype=x.dtype, device=x.device).index_add_(0, row_tile, x)
    count = torch.bincount(row_tile, minlength=ntiles).to(x.dtype)
    return total / count.view(-1, *([1] * (x.dim() - 1)))


def pruned_mass_share(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    index: BlockIndex,
    *,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
) -> TileMassShare:
    """Share of the exact softmax mass that each tile's pruned blocks hold.

    Row ``r`` (query position ``p``, bottom-right causal) sees keys ``0 .. prefix + p``;
    its mass share of block ``J`` is ``sum_{i in J visible} exp(s_ri) / sum_{i visible} exp(s_ri)``
    with ``s_ri = q_r . k_i * scale`` (FP8 inputs in real units). Per segment the pruned
    share is averaged over the tile's rows (and its maximum reported). Work is
    vectorised over the rows and keys of whole tiles, one (request, KV head) at a time.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        batch: the paged prefill batch.
        index: the block index to assess (built for ``batch``).
        softmax_scale: logit scale, ``1 / sqrt(d)`` by default.
        compute_dtype: float32 or float64, the dtype of the logits and of the results.
        q_descale: ``(B, Hkv) float32`` query descales, required for FP8 inputs.
        k_descale: ``(B, Hkv) float32`` key descales, required for FP8 inputs.

    Returns:
        The per-segment :class:`TileMassShare` on ``q``'s device.

    Raises:
        TypeError: wrong argument types or dtypes, naming the argument.
        ValueError: inputs that do not fit the batch, or an index built for other
            tiles, group, heads or batch.
    """
    shapes, scale = check_inputs(
        q,
        k_cache,
        None,
        batch,
        index,
        softmax_scale=softmax_scale,
        compute_dtype=compute_dtype,
        descales=(q_descale, k_descale, None),
    )
    device = q.device
    num_segments = index.num_segments
    results = {name: torch.zeros(num_segments, dtype=compute_dtype, device=device) for name in _FIELDS}
    for chunk in walk_tile_chunks(
        q,
        k_cache,
        None,
        batch,
        index,
        shapes,
        scale=scale,
        compute_dtype=compute_dtype,
        descales=(q_descale, k_descale, None),
    ):
        block_mass = chunk.weights.sum(dim=2)  # (R, nb)
        share = block_mass / block_mass.sum(dim=1, keepdim=True)
        pruned = ~chunk.kept  # (T, nb)
        uncorrectable = pruned & ~chunk.eligible
        row_pruned = (share * pruned[chunk.row_tile]).sum(dim=1)
        row_uncorrectable = (share * uncorrectable[chunk.row_tile]).sum(dim=1)

        ntiles = chunk.kept.shape[0]
        # Shares are >= 0, so a zero start leaves the per-tile maximum unchanged.
        row_max = torch.zeros(ntiles, dtype=compute_dtype, device=device)
        row_max.scatter_reduce_(0, chunk.row_tile, row_pruned, reduce="amax")
        block_share = _tile_mean(share, chunk.row_tile, ntiles)  # (T, nb): tile-mean mass share of every block
        segs = chunk.segments
        results["share_mean"][segs] = _tile_mean(row_pruned, chunk.row_tile, ntiles)
        results["share_max"][segs] = row_max
        results["uncorrectable_share_mean"][segs] = _tile_mean(row_uncorrectable, chunk.row_tile, ntiles)
        results["max_pruned_block_share"][segs] = (block_share * pruned).amax(dim=1)
        results["max_block_share"][segs] = block_share.amax(dim=1)
    request, kv_head, tile = (t.to(device) for t in segment_coordinates(index))
    return TileMassShare(request=request, kv_head=kv_head, tile=tile, **results)
