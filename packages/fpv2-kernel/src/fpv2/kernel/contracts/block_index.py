"""The block index: per (request, KV head, query tile), the ascending kept key blocks (CSR)."""

from __future__ import annotations

import weakref
from dataclasses import InitVar, dataclass
from functools import cached_property

import torch

from ._checks import check_contiguous, check_positive_int, check_tensor, describe
from .geometry import BLOCK_SIZE, TILE_SIZE, num_query_tiles, tile_span
from .paged_batch import PagedPrefillBatch

#: Segment order of every block index: request-major, then KV head, then tile.
SEGMENT_ORDER = ("request", "kv_head", "tile")


@dataclass(frozen=True, eq=False)
class BlockIndex:
    """Kept key blocks per query tile, in CSR form; every strategy emits it, every kernel reads it.

    Segment ``s`` is one (request ``b``, KV head ``h``, tile ``t``) with
    ``s = num_kv_heads * tile_offsets[b] + h * ntiles_b + t`` where
    ``ntiles_b = tile_offsets[b+1] - tile_offsets[b]`` (see :data:`SEGMENT_ORDER`).
    Its kept blocks are ``blocks[offsets[s]:offsets[s+1]]``, strictly ascending
    block ids in units of ``block_size`` absolute KV tokens, all causally visible
    to the tile (``J * block_size <= prefix + p_last``).

    Args:
        offsets: ``(S+1,) int32``, ``offsets[0] == 0``, non-decreasing.
        blocks: ``(capacity,) int32`` block ids; the first ``nnz = offsets[-1]`` are
            the index, any entries after them are spare capacity that kernels never
            read (lets a producer size the array without a host sync).
        tile_offsets: ``(B+1,) int32`` cumulative query tiles per request (per KV head).
        num_kv_heads: ``Hkv``.
        group: GQA group size ``g`` the tiles were packed with.
        tile_size: packed rows per tile (the kernel checks it equals its own).
        block_size: tokens per key block.
        check_values: check the index values (host sync).
    """

    offsets: torch.Tensor
    blocks: torch.Tensor
    tile_offsets: torch.Tensor
    num_kv_heads: int
    group: int
    tile_size: int = TILE_SIZE
    block_size: int = BLOCK_SIZE
    check_values: InitVar[bool] = True

    def __post_init__(self, check_values: bool) -> None:
        check_positive_int("num_kv_heads", self.num_kv_heads)
        check_positive_int("group", self.group)
        check_positive_int("tile_size", self.tile_size, power_of_two=True)
        check_positive_int("block_size", self.block_size, power_of_two=True)
        off = check_tensor("offsets", self.offsets, dtypes=(torch.int32,), ndim=1)
        check_tensor("blocks", self.blocks, dtypes=(torch.int32,), ndim=1, device=off.device)
        check_tensor("tile_offsets", self.tile_offsets, dtypes=(torch.int32,), ndim=1, device=off.device)
        for name in ("offsets", "blocks", "tile_offsets"):
            check_contiguous(name, getattr(self, name))
        if off.numel() < 1 or self.tile_offsets.numel() < 2:
            raise ValueError(
                f"block index needs offsets (S+1,) and tile_offsets (B+1,) with B >= 1; got offsets {describe(off)}, "
                f"tile_offsets {describe(self.tile_offsets)}"
            )
        if check_values:
            self.validate_values()

    @cached_property
    def _checked_batches(self) -> weakref.WeakKeyDictionary:
        """Batches this index was found compatible with (and for which group): later kernel calls
        with the same index and batch, e.g. every layer of one forward, skip the device reads."""
        return weakref.WeakKeyDictionary()

    def validate_values(self) -> None:
        """Check the CSR structure (host sync): offsets, sizes, ascending ids."""
        off = self.offsets.cpu().long()
        tiles = self.tile_offsets.cpu().long()
        blocks = self.blocks.cpu().long()
        if tiles[0] != 0 or (tiles[1:] < tiles[:-1]).any():
            raise ValueError(f"tile_offsets must start at 0 and be non-decreasing; got {tiles.tolist()[:16]}")
        expected_segments = self.num_kv_heads * int(tiles[-1])
        if off.numel() != expected_segments + 1:
            raise ValueError(
                f"offsets must have num_kv_heads * tile_offsets[-1] + 1 = {expected_segments + 1} entries; "
                f"got {describe(self.offsets)}"
            )
        if off[0] != 0 or (off[1:] < off[:-1]).any():
            raise ValueError("offsets must start at 0 and be non-decreasing")
        if int(off[-1]) > blocks.numel():
            raise ValueError(f"offsets[-1]={int(off[-1])} exceeds the capacity of blocks; got {describe(self.blocks)}")
        blocks = blocks[: int(off[-1])]
        if (blocks < 0).any():
            raise ValueError(f"block ids must be >= 0; found {int(blocks.min())}")
        if blocks.numel() > 1:
            seg_of = torch.repeat_interleave(torch.arange(off.numel() - 1), off[1:] - off[:-1])
            same = seg_of[1:] == seg_of[:-1]
            if (same & (blocks[1:] <= blocks[:-1])).any():
                s = int(seg_of[1:][same & (blocks[1:] <= blocks[:-1])][0])
                raise ValueError(
                    f"block ids must be strictly ascending within a segment; segment {s} holds "
                    f"{blocks[off[s] : off[s + 1]].tolist()[:16]}"
                )

    # ------------------------------------------------------------------ layout
    @property
    def num_requests(self) -> int:
        """Number of requests ``B``."""
        return self.tile_offsets.numel() - 1

    @property
    def num_segments(self) -> int:
        """Number of (request, KV head, tile) segments ``S``."""
        return self.offsets.numel() - 1

    @property
    def nnz(self) -> int:
        """Number of kept (tile, block) pairs, ``offsets[-1]`` (host sync)."""
        return int(self.offsets[-1])

    @property
    def kept(self) -> torch.Tensor:
        """``(nnz,) int32`` the kept block ids without spare capacity (host sync)."""
        return self.blocks[: self.nnz]

    def segment(self, request: int, kv_head: int, tile: int) -> int:
        """Segment id of (request, KV head, tile) under :data:`SEGMENT_ORDER` (host values)."""
        tiles = self.tile_offsets.cpu()
        start, end = int(tiles[request]), int(tiles[request + 1])
        if not 0 <= tile < end - start:
            raise IndexError(f"tile {tile} out of range for request {request} with {end - start} tiles")
        if not 0 <= kv_head < self.num_kv_heads:
            raise IndexError(f"kv_head {kv_head} out of range for {self.num_kv_heads} KV heads")
        return self.num_kv_heads * start + kv_head * (end - start) + tile

    def kept_blocks(self, request: int, kv_head: int, tile: int) -> list[int]:
        """Kept block ids of one segment, as a host list."""
        s = self.segment(request, kv_head, tile)
        off = self.offsets.cpu()
        return self.blocks[int(off[s]) : int(off[s + 1])].cpu().tolist()

    def check_compatible(self, batch: PagedPrefillBatch, group: int, *, tile_size: int | None = None) -> None:
        """Check that this index was built for ``batch``, ``group`` and (optionally) a kernel tile size.

        Raises ``ValueError`` naming the mismatch: a kernel must never walk an index
        built for other tiles (the published implementation assumed it silently).

        The value checks (tile offsets and causality) read the device, two host syncs;
        they run once per (index, batch) pair, and not at all for a batch recorded
        with :meth:`assume_compatible` by the index's producer.
        """
        if tile_size is not None and tile_size != self.tile_size:
            raise ValueError(
                f"block index tile_size={self.tile_size} differs from the kernel's query tile {tile_size}; "
                "build the index with the kernel's tile size"
            )
        if group != self.group:
            raise ValueError(f"block index was packed for GQA group {self.group}, the inputs have group {group}")
        if self._checked_batches.get(batch) == group:
            return  # the value checks below read the device: once per (index, batch), not once per layer
        if self.num_requests != batch.num_requests:
            raise ValueError(f"block index covers {self.num_requests} requests, the batch has {batch.num_requests}")
        expected = expected_tile_offsets(batch, group, self.tile_size)
        if not torch.equal(expected.cpu(), self.tile_offsets.cpu()):
            raise ValueError(
                f"block index tile_offsets {self.tile_offsets.cpu().tolist()[:8]} do not match the batch "
                f"({expected.tolist()[:8]} for group {group}, tile_size {self.tile_size})"
            )
        bad, last_kept, last_visible = self._causal_violations(batch)
        if bool(bad.any()):
            s = int(torch.nonzero(bad)[0, 0])
            b, h, t = self.locate_segment(s)
            raise ValueError(
                f"segment (request {b}, kv_head {h}, tile {t}) keeps block {int(last_kept[s])}, beyond the "
                f"causally visible blocks 0..{int(last_visible[s])}"
            )
        self._checked_batches[batch] = group

    def assume_compatible(self, batch: PagedPrefillBatch, group: int) -> BlockIndex:
        """Record that this index was derived from ``batch`` itself, so kernels skip the device reads.

        For producers that build the index from the very batch object it will be
        used with (every selection strategy of ``fpv2.index`` called through a
        pipeline does): their tile offsets come from the batch's own query offsets
        and their block ids are causal by construction, so the value checks of
        :meth:`check_compatible` (two host syncs) would only re-read what the
        producer just wrote. This is the index-side counterpart of
        :meth:`PagedPrefillBatch.assume_host_view`. The checks that need no device
        read still run here: request count, and segment count against the tiles of
        the batch's host view (cached on the batch, seeded by engines); group and
        tile size are checked again by every :meth:`check_compatible` call.

        Args:
            batch: the batch the index was built from.
            group: GQA group size ``g`` the index was packed with.

        Returns:
            ``self``, for chaining.

        Raises:
            ValueError: the index was packed for another group, or its request or
                segment count does not fit ``batch``.
        """
        if group != self.group:
            raise ValueError(f"block index was packed for GQA group {self.group}, not {group}")
        if self.num_requests != batch.num_requests:
            raise ValueError(f"block index covers {self.num_requests} requests, the batch has {batch.num_requests}")
        tiles = sum(num_query_tiles(n, group, self.tile_size) for n in batch.host.q_lens)
        if self.num_segments != self.num_kv_heads * tiles:
            raise ValueError(
                f"block index has {self.num_segments} segments; the batch has {tiles} tiles of {self.tile_size} rows "
                f"per KV head (group {group}), i.e. {self.num_kv_heads * tiles} segments for {self.num_kv_heads} KV "
                "heads"
            )
        self._checked_batches[batch] = group
        return self

    def _causal_violations(self, batch: PagedPrefillBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per segment: (last kept block > last visible block, last kept block, last visible block).

        Vectorised over segments on the index's device (ids are ascending, so the
        last kept block is the largest).
        """
        device = self.offsets.device
        tiles = self.tile_offsets.to(device=device, dtype=torch.long)
        ntiles = tiles[1:] - tiles[:-1]
        seg_start = self.num_kv_heads * tiles[:-1]
        num_segments = self.num_segments
        request = torch.repeat_interleave(
            torch.arange(self.num_requests, device=device), ntiles * self.num_kv_heads, output_size=num_segments
        )
        local = torch.arange(num_segments, device=device) - seg_start[request]
        tile = local % ntiles[request].clamp(min=1)
        rows = batch.q_lens.to(device=device, dtype=torch.long)[request] * self.group
        row_end = torch.minimum((tile + 1) * self.tile_size, rows)
        p_last = (row_end - 1) // self.group
        prefix = batch.prefix.to(device=device, dtype=torch.long)[request]
        last_visible = (prefix + p_last) // self.block_size
        offsets = self.offsets.long()
        counts = offsets[1:] - offsets[:-1]
        last_kept = self.blocks.long()[(offsets[1:] - 1).clamp(min=0)] if self.blocks.numel() else counts
        return (counts > 0) & (last_kept > last_visible), last_kept, last_visible

    def locate_segment(self, segment: int) -> tuple[int, int, int]:
        """Inverse of :meth:`segment`: ``(request, kv_head, tile)`` of a segment id (host values).

        Args:
            segment: a segment id in ``0 .. num_segments - 1``.

        Returns:
            The segment's request, KV head and tile.
        """
        tiles = self.tile_offsets.cpu().tolist()
        for b in range(self.num_requests):
            n = tiles[b + 1] - tiles[b]
            start = self.num_kv_heads * tiles[b]
            if start <= segment < start + self.num_kv_heads * n:
                return b, (segment - start) // n, (segment - start) % n
        raise IndexError(f"segment {segment} out of range for {self.num_segments} segments")

    # ---------------------------------------------------------------- helpers
    def visible_pairs(self, batch: PagedPrefillBatch) -> int:
        """Causally visible (tile, block) pairs of ``batch`` summed over KV heads."""
        host = batch.host
        total = 0
        for q_len, prefix in zip(host.q_lens, host.prefix):
            for t in range(num_query_tiles(q_len, self.group, self.tile_size)):
                span = tile_span(t, q_len, prefix, self.group, tile_size=self.tile_size, block_size=self.block_size)
                total += span.num_visible_blocks
        return total * self.num_kv_heads

    def density(self, batch: PagedPrefillBatch) -> float:
        """Kept pairs over causally visible pairs, in selection blocks (1.0 = dense)."""
        visible = self.visible_pairs(batch)
        return self.nnz / visible if visible else 1.0

    def to_dense_mask(self, num_blocks: int | None = None) -> torch.Tensor:
        """``(S, num_blocks) bool`` mask of kept blocks per segment (for tests and plots)."""
        blocks = self.kept.long()
        if num_blocks is None:
            num_blocks = int(blocks.max()) + 1 if blocks.numel() else 0
        counts = self.offsets[1:] - self.offsets[:-1]
        rows = torch.repeat_interleave(torch.arange(self.num_segments, device=blocks.device), counts.long())
        mask = torch.zeros(self.num_segments, num_blocks, dtype=torch.bool, device=blocks.device)
        mask[rows, blocks] = True
        return mask

    @classmethod
    def from_dense_mask(
        cls,
        mask: torch.Tensor,
        tile_offsets: torch.Tensor,
        *,
        num_kv_heads: int,
        group: int,
        tile_size: int = TILE_SIZE,
        block_size: int = BLOCK_SIZE,
    ) -> BlockIndex:
        """Compact a ``(S, num_blocks) bool`` kept-block mask into CSR (``torch.nonzero`` syncs once)."""
        check_tensor("mask", mask, dtypes=(torch.bool,), ndim=2)
        counts = mask.sum(dim=1, dtype=torch.int32)
        offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
        offsets[1:] = counts.cumsum(0)
        blocks = torch.nonzero(mask)[:, 1].to(torch.int32).contiguous()
        return cls(offsets, blocks, tile_offsets.to(torch.int32), num_kv_heads, group, tile_size, block_size)


def expected_tile_offsets(batch: PagedPrefillBatch, group: int, tile_size: int = TILE_SIZE) -> torch.Tensor:
    """``(B+1,) int32`` cumulative query tiles per request for ``batch`` (host tensor)."""
    tiles = [num_query_tiles(q, group, tile_size) for q in batch.host.q_lens]
    out = torch.zeros(len(tiles) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(tiles, dtype=torch.int32).cumsum(0)
    return out
