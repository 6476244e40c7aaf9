"""What one request carries from chunk to chunk of a chunked prefill.

When an engine prefills a long prompt in chunks, every chunk is a prefill on
top of the KV of the chunks before it. Two things must not be recomputed per
chunk, or the chunked run is slower and denser than the unchunked one:

- the pooled key/value statistics of the complete blocks already seen: a
  :class:`ChunkedPrefillState` keeps them (fp32 means, as
  :class:`fpv2.kernel.BlockStatistics` stores them), so a chunk only pools the
  blocks it touches (:mod:`.chunked_pooling`);
- the whole-prompt geometry: ``prompt_len`` (the KV length once the prompt is
  prefilled, cached prefix included) and ``prefill_start`` (the KV position of
  the first query of the whole prefill), so that the dense fallbacks of the
  index refer to the prompt, not to the chunk (:meth:`ChunkedPrefillState.dense_tile_count`).

Tiles are numbered from ``prefill_start``: packed row ``r`` of the whole
prefill is query position ``prefill_start + r // g``, exactly as in the
unchunked call, so a chunk whose first query sits at ``prefix`` starts at
whole-prefill packed row ``(prefix - prefill_start) * g``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fpv2.index import SelectionConfig
from fpv2.index.reference.forced import dense_tile_count
from fpv2.kernel.contracts import BLOCK_SIZE, cdiv, num_key_blocks, num_query_tiles


def suffix_mask(num_tiles: int, count: int) -> torch.Tensor:
    """``(num_tiles,) bool`` CPU mask of the last ``count`` tiles (a dense-tile count as a mask).

    Args:
        num_tiles: tiles of the request's chunk.
        count: dense last tiles.

    Returns:
        The mask.
    """
    return torch.arange(num_tiles) >= num_tiles - count


def _check_int(name: str, value: object, *, minimum: int) -> int:
    """Refuse non-ints (bools included) and values below ``minimum``, naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(eq=False)
class ChunkedPrefillState:
    """Per-request carry of a chunked prefill: pooled statistics and the whole-prompt geometry.

    Create one per request before its first chunk and pass it with every chunk
    of that request; call :meth:`reset` if the request's KV is recomputed from
    scratch (e.g. after preemption). Statistics views handed out by
    :meth:`statistics_rows` alias the state's buffers and are valid until the
    next chunk of the same request is pooled.

    Args:
        prompt_len: KV length of the request when its whole prompt has been
            prefilled (``seqlens_k`` of the equivalent unchunked call, cached
            prefix included). ``None`` when unknown: the dense fallbacks then
            fall back to the per-chunk rule (see :meth:`dense_tile_count`).
        prefill_start: KV position of the first query of the whole prefill (the
            prefix that was cached before the first chunk); tiles are numbered
            from it. Default 0.
        block_size: tokens per key block of the pooled statistics; must equal
            the selection's ``block_size``.

    Attributes:
        num_tokens: KV tokens covered by the pooled statistics (the partial tail
            block, if any, is pooled over its real length and pooled again by
            the next chunk).
        pooled_k: ``(capacity, Hkv, d) float32`` pooled keys (None before the first chunk).
        pooled_v: pooled values, or None when the statistics carry keys only.
        block_lengths: ``(capacity,) int32`` valid tokens per pooled block.
        pooled_blocks: blocks pooled so far, over all chunks (each re-pool counts).
        chunks: chunks pooled so far.
        tile_k: ``(pages, 128, Hkv, d)`` keys of the whole prompt in tile pages, when the backend
            runs the chunks on such a copy (:mod:`.chunked_tile_pages`), else None.
        tile_v: the values in tile pages, or None.
        tile_table: ``(1, pages) int32`` page table of the tile pages (page ``j`` is ``j``), or None.
        tile_tokens: KV tokens the tile pages hold (0 without them).

    Raises:
        TypeError: an argument is not an int (or None for ``prompt_len``).
        ValueError: a negative length, ``prefill_start > prompt_len``, or a
            ``block_size`` that is not a power of two.
    """

    prompt_len: int | None = None
    prefill_start: int = 0
    block_size: int = BLOCK_SIZE
    num_tokens: int = field(default=0, init=False)
    pooled_k: torch.Tensor | None = field(default=None, init=False, repr=False)
    pooled_v: torch.Tensor | None = field(default=None, init=False, repr=False)
    block_lengths: torch.Tensor | None = field(default=None, init=False, repr=False)
    pooled_blocks: int = field(default=0, init=False)
    chunks: int = field(default=0, init=False)
    tile_k: torch.Tensor | None = field(default=None, init=False, repr=False)
    tile_v: torch.Tensor | None = field(default=None, init=False, repr=False)
    tile_table: torch.Tensor | None = field(default=None, init=False, repr=False)
    tile_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.prompt_len is not None:
            _check_int("prompt_len", self.prompt_len, minimum=0)
        _check_int("prefill_start", self.prefill_start, minimum=0)
        _check_int("block_size", self.block_size, minimum=1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.prompt_len is not None and self.prefill_start > self.prompt_len:
            raise ValueError(
                f"prefill_start={self.prefill_start} lies past the end of the prompt (prompt_len={self.prompt_len})"
            )

    # ------------------------------------------------------------------ geometry
    @property
    def num_blocks(self) -> int:
        """Pooled blocks currently valid, ``ceil(num_tokens / block_size)``."""
        return num_key_blocks(self.num_tokens, self.block_size)

    def check_chunk(self, prefix: int, q_len: int) -> None:
        """Check that a chunk with ``q_len`` queries after ``prefix`` KV tokens belongs to this prefill.

        Args:
            prefix: KV tokens before the chunk's first query.
            q_len: queries of the chunk.

        Raises:
            ValueError: the chunk starts before ``prefill_start`` or ends past ``prompt_len``.
        """
        if prefix < self.prefill_start:
            raise ValueError(
                f"chunk starts at KV position {prefix}, before the prefill's first query (prefill_start="
                f"{self.prefill_start}); create a new ChunkedPrefillState for a new prefill"
            )
        if self.prompt_len is not None and prefix + q_len > self.prompt_len:
            raise ValueError(
                f"chunk ends at KV position {prefix + q_len}, past prompt_len={self.prompt_len} of its state"
            )

    def first_touched_block(self, prefix: int) -> int:
        """First block a chunk after ``prefix`` KV tokens must pool.

        Blocks before it are complete and already pooled. It is the previous
        partial tail block when the pooled tokens end mid-block, and it moves
        back to the chunk's own first block if the chunk rewrites tokens that
        were pooled before (a retried chunk).

        Args:
            prefix: KV tokens before the chunk's first query.

        Returns:
            The block id ``min(num_tokens, prefix) // block_size``.
        """
        return min(self.num_tokens, prefix) // self.block_size

    def dense_tile_count(self, prefix: int, q_len: int, group: int, config: SelectionConfig) -> int:
        """How many of a chunk's tiles keep every visible block, by the whole-prompt rule: always its last ones.

        With ``prompt_len`` known, a chunk tile is dense when the prompt is short
        (``prompt_len < config.min_sparse_kv_len``, the unchunked rule on the
        unchunked ``seqlens_k``) or when it holds a packed row of one of the
        last ``config.dense_tail_tiles`` tiles of the whole prefill. When chunk
        boundaries fall on tile boundaries this is exactly the unchunked rule
        restricted to the chunk; otherwise a chunk tile straddling the start of
        the dense tail is dense too (never fewer dense rows than unchunked).

        Without ``prompt_len`` the per-chunk rule of
        :func:`fpv2.index.reference.forced.dense_tile_count` applies (the chunk's
        own last tiles, and its current KV length against ``min_sparse_kv_len``):
        any chunk might be the last one.

        Plain integer arithmetic (no tensors): it runs once per chunk and request on the host.

        Args:
            prefix: KV tokens before the chunk's first query.
            q_len: queries of the chunk.
            group: GQA group size ``g``.
            config: selection parameters (``tile_size``, ``dense_tail_tiles``, ``min_sparse_kv_len``).

        Returns:
            ``n``: the chunk's last ``n`` tiles are dense, the others are not.

        Raises:
            ValueError: the chunk does not belong to this prefill (see :meth:`check_chunk`).
        """
        self.check_chunk(prefix, q_len)
        tile_size = config.tile_size
        rows = q_len * group
        num_tiles = cdiv(rows, tile_size)
        if self.prompt_len is None:
            return dense_tile_count(num_tiles, prefix + q_len, config)
        if self.prompt_len < config.min_sparse_kv_len:
            return num_tiles
        prompt_tiles = cdiv((self.prompt_len - self.prefill_start) * group, tile_size)
        dense_from_row = max(prompt_tiles - config.dense_tail_tiles, 0) * tile_size
        first_row = (prefix - self.prefill_start) * group
        # Tile t's last row is first_row + min((t + 1) * tile_size, rows) - 1: dense once it reaches dense_from_row.
        needed = dense_from_row - first_row + 1
        if needed <= 0:
            return num_tiles
        if needed > rows:
            return 0
        return num_tiles - (cdiv(needed, tile_size) - 1)

    def dense_tile_mask(self, prefix: int, q_len: int, group: int, config: SelectionConfig) -> torch.Tensor:
        """``(T,) bool`` CPU mask of the tiles of a chunk that keep every visible block.

        :meth:`dense_tile_count` as a mask: same arguments, same errors.
        """
        count = self.dense_tile_count(prefix, q_len, group, config)
        return suffix_mask(num_query_tiles(q_len, group, config.tile_size), count)

    # ------------------------------------------------------------------ storage
    def store(
        self,
        first_block: int,
        pooled_k: torch.Tensor,
        pooled_v: torch.Tensor | None,
        block_lengths: torch.Tensor | None,
        kv_len: int,
    ) -> None:
        """Write freshly pooled blocks ``first_block ..`` and advance the pooled length to ``kv_len``.

        Args:
            first_block: block id of the first row of ``pooled_k``.
            pooled_k: ``(n, Hkv, d) float32`` pooled keys of blocks ``first_block .. first_block + n - 1``.
            pooled_v: matching pooled values, or None (keys only).
            block_lengths: ``(n,) int32`` valid tokens per block (may be None when ``n == 0``).
            kv_len: KV tokens covered once these blocks are stored; must end in the last stored block.

        Raises:
            ValueError: blocks do not continue the pooled range, ``kv_len`` does not match them,
                the heads, head dim or device differ from earlier chunks, or values appear or
                disappear between chunks.
        """
        n = pooled_k.shape[0]
        if first_block > self.num_blocks:
            raise ValueError(f"pooled blocks start at {first_block}, after the {self.num_blocks} blocks pooled so far")
        if num_key_blocks(kv_len, self.block_size) != first_block + n:
            raise ValueError(
                f"kv_len={kv_len} needs {num_key_blocks(kv_len, self.block_size)} blocks, the state would hold "
                f"{first_block + n} (first_block {first_block} + {n} new)"
            )
        if n == 0:  # nothing new: only the covered length moves (back to a block boundary at most)
            self.num_tokens = kv_len
            self.chunks += 1
            return
        if self.pooled_k is not None:
            if tuple(self.pooled_k.shape[1:]) != tuple(pooled_k.shape[1:]) or self.pooled_k.device != pooled_k.device:
                raise ValueError(
                    f"pooled_k rows of shape {tuple(pooled_k.shape[1:])} on {pooled_k.device} do not match the "
                    f"state's (Hkv, d)={tuple(self.pooled_k.shape[1:])} on {self.pooled_k.device}"
                )
            if (self.pooled_v is None) != (pooled_v is None):
                raise ValueError("pooled_v must be given for every chunk of a request or for none")
        self._reserve(first_block + n, pooled_k, pooled_v is not None)
        rows = slice(first_block, first_block + n)
        self.pooled_k[rows] = pooled_k
        if pooled_v is not None:
            self.pooled_v[rows] = pooled_v
        self.block_lengths[rows] = block_lengths
        self.num_tokens = kv_len
        self.pooled_blocks += n
        self.chunks += 1

    def _reserve(self, blocks: int, like: torch.Tensor, with_values: bool) -> None:
        """Make room for ``blocks`` rows: the whole prompt at once when its length is known, else doubling."""
        capacity = 0 if self.pooled_k is None else self.pooled_k.shape[0]
        if blocks <= capacity:
            return
        wanted = num_key_blocks(self.prompt_len, self.block_size) if self.prompt_len is not None else 0
        new_capacity = max(blocks, wanted, 2 * capacity)
        old = self.num_blocks

        def grow(buffer: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            fresh = torch.zeros((new_capacity, *shape), dtype=dtype, device=like.device)
            if buffer is not None and old:
                fresh[:old] = buffer[:old]
            return fresh

        self.pooled_k = grow(self.pooled_k, tuple(like.shape[1:]), torch.float32)
        self.pooled_v = grow(self.pooled_v, tuple(like.shape[1:]), torch.float32) if with_values else None
        self.block_lengths = grow(self.block_lengths, (), torch.int32)

    def statistics_rows(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Views of the valid pooled rows ``0 .. num_blocks - 1``.

        Returns:
            ``(pooled_k (nb, Hkv, d), pooled_v or None, block_lengths (nb,))``.

        Raises:
            RuntimeError: nothing has been pooled yet.
        """
        if self.pooled_k is None:
            raise RuntimeError("this ChunkedPrefillState has pooled nothing yet")
        nb = self.num_blocks
        pooled_v = self.pooled_v[:nb] if self.pooled_v is not None else None
        return self.pooled_k[:nb], pooled_v, self.block_lengths[:nb]

    def reset(self) -> None:
        """Forget the pooled statistics and tile pages (the KV is recomputed from scratch); keep the geometry."""
        self.num_tokens = 0
        self.pooled_k = self.pooled_v = self.block_lengths = None
        self.tile_k = self.tile_v = self.tile_table = None
        self.tile_tokens = 0
        self.pooled_blocks = 0
        self.chunks = 0
