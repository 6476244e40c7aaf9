"""Incremental block pooling for chunked prefill: pool only the blocks a chunk touches.

A chunk that ends at KV length ``kv_len`` on top of ``num_tokens`` pooled
tokens touches blocks ``num_tokens // Bk .. ceil(kv_len / Bk) - 1``: the
previous partial tail block (pooled again now that it has more tokens) and
the new ones. Every block before them is complete and its pooled K/V is read
from the request's :class:`~.chunked_state.ChunkedPrefillState`. Over a
prompt of ``L`` tokens in chunks of ``C`` this pools about ``L / Bk`` blocks
in total instead of ``L^2 / (2 C Bk)``.

Pooling runs on a *touched-blocks batch*: the chunk's batch with each
request's page table advanced to its first touched block (possible whenever
that block starts on a page boundary, e.g. any power-of-two page size up to
``Bk``), so the regular pooling kernels (the fused Triton kernel on CUDA, the
PyTorch reference elsewhere) pool exactly those blocks; other page sizes use a
direct token gather. Both give the same values as pooling from scratch: each
block's mean depends only on its own tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from fpv2.kernel.contracts import BLOCK_SIZE, BlockStatistics, HostBatchView, PagedPrefillBatch, num_key_blocks
from fpv2.kernel.reference.pooling import pool_blocks, pool_request

from .chunked_state import ChunkedPrefillState
from .transfer import device_ints

if TYPE_CHECKING:
    from fpv2.kernel.triton.tile_repack import TileRepacked

#: Tokens per carried tile page: the Hopper kernel's KV tile, the contracts' key block.
TILE_TOKENS = BLOCK_SIZE


class ChunkStatistics(NamedTuple):
    """Pooled statistics of one chunk batch and what pooling them cost.

    Attributes:
        statistics: pooled K (and V) of every block of every request of the chunk batch.
        pooled_blocks: blocks actually pooled for this chunk (touched blocks, all requests).
        tile_pages_copied: the pooling kernel also filled the request's carried tile pages up to the
            chunk's KV length (``copy_tile_pages``).
    """

    statistics: BlockStatistics
    pooled_blocks: int
    tile_pages_copied: bool = False


def batch_from_host(
    seqlens_q: Sequence[int],
    seqlens_k: Sequence[int],
    page_table: torch.Tensor,
    *,
    page_size: int,
    num_pages: int,
) -> PagedPrefillBatch:
    """A :class:`PagedPrefillBatch` built from host lengths, with its host view filled from them.

    The lengths come from the host, so reading them back from the device (the
    batch's ``host`` view) would be a needless synchronisation; the batch's
    cached ``host`` view is seeded with them instead, and they reach the device
    in one non-blocking copy (:func:`fpv2.index.transfer.device_ints`). Values are not re-checked.

    Args:
        seqlens_q: new queries per request.
        seqlens_k: KV length per request, prefix included.
        page_table: ``(B, max_pages) int32`` on the target device, rows contiguous.
        page_size: tokens per page.
        num_pages: pages of the cache.

    Returns:
        The batch, on ``page_table``'s device.
    """
    return _batch_and_ints(seqlens_q, seqlens_k, page_table, page_size=page_size, num_pages=num_pages)[0]


def _batch_and_ints(
    seqlens_q: Sequence[int],
    seqlens_k: Sequence[int],
    page_table: torch.Tensor,
    *,
    page_size: int,
    num_pages: int,
    trailing: Sequence[int] = (),
) -> tuple[PagedPrefillBatch, torch.Tensor]:
    """:func:`batch_from_host`, with ``trailing`` host ints copied to the device in the same copy (returned)."""
    cu = [0]
    for n in seqlens_q:
        cu.append(cu[-1] + int(n))
    kv = [int(k) for k in seqlens_k]
    # One non-blocking copy of every array (a blocking torch.tensor(..., device=...) per array
    # would stall the host until the device has caught up, once per chunk).
    packed = device_ints([*cu, *kv, *trailing], page_table.device)
    batch = PagedPrefillBatch(
        cu_seqlens_q=packed[: len(cu)],
        seqlens_k=packed[len(cu) : len(cu) + len(kv)],
        page_table=page_table,
        page_size=page_size,
        num_pages=num_pages,
        check_values=False,
    )
    # The caller's host lists spare the batch a device read of its lengths.
    return batch.assume_host_view(HostBatchView(cu_seqlens_q=cu, seqlens_k=kv)), packed[len(cu) + len(kv) :]


def _pool_touched_paged(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    batch: PagedPrefillBatch,
    first_blocks: list[int],
    *,
    block_size: int,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    use_triton: bool,
    tile_state: ChunkedPrefillState | None = None,
    trailing: Sequence[int] = (),
) -> tuple[BlockStatistics, torch.Tensor]:
    """Pool blocks ``first_blocks[b] ..`` of every request through a page table advanced to them.

    With ``tile_state`` (one request, the Triton kernel, ``block_size`` = 128) the same launch copies the
    touched blocks' tokens into that state's tile pages ``first_blocks[0] ..``. ``trailing`` host ints ride
    the touched batch's copy to the device and come back as the second result.
    """
    host = batch.host
    page_size = batch.page_size
    first_pages = [j * block_size // page_size for j in first_blocks]
    lengths = [kv - j * block_size for kv, j in zip(host.seqlens_k, first_blocks)]
    width = max(max((num_key_blocks(n, page_size) for n in lengths), default=1), 1)
    if len(set(first_pages)) == 1:
        # Every request starts at the same page (one request, or requests chunked in lockstep):
        # the advanced table is a view, no gather.
        table = batch.page_table[:, first_pages[0] :]
        if table.shape[1] == 0:
            table = batch.page_table[:, :1]  # nothing left to pool: any one column (never read)
    else:
        device = batch.device
        cols = device_ints(first_pages, device, dtype=torch.int64)[:, None] + torch.arange(width, device=device)
        # Columns past a request's last page are ignored by the pooling: clamp them into the table.
        cols = cols.clamp(max=max(batch.page_table.shape[1] - 1, 0))
        table = torch.gather(batch.page_table, 1, cols).contiguous()
    touched, ints = _batch_and_ints(
        [0] * len(lengths), lengths, table, page_size=page_size, num_pages=batch.num_pages, trailing=trailing
    )
    if use_triton:
        from fpv2.index.triton import pool_blocks_triton  # imports triton: only on the fast path

        tiles = _tile_pages_target(tile_state, touched, first_blocks[0]) if tile_state is not None else None
        statistics = pool_blocks_triton(
            k_cache,
            v_cache,
            touched,
            block_size=block_size,
            k_descale=k_descale,
            v_descale=v_descale,
            tile_copies=tiles,
        )
    else:
        statistics = pool_blocks(
            k_cache, v_cache, touched, block_size=block_size, k_descale=k_descale, v_descale=v_descale
        )
    return statistics, ints


def _tile_pages_target(state: ChunkedPrefillState, touched: PagedPrefillBatch, first_block: int) -> TileRepacked:
    """The state's tile pages ``first_block ..`` as the pooling kernel's copy target for the touched batch.

    The kernel writes touched block ``i`` to tile page ``i`` of the target and ``i`` into the target's page
    table: the pages are a view of the state's (page ``first_block + i``), the table the touched batch's own
    tile batch (the state's table maps page ``j`` to ``j`` and is not rewritten).
    """
    from fpv2.kernel.triton.tile_repack import TileRepacked, tile_batch, tile_pages_per_request

    rows = slice(first_block, first_block + tile_pages_per_request(touched)[0])
    return TileRepacked(state.tile_k[rows], state.tile_v[rows], tile_batch(touched))


def _pool_touched_gather(
    cache: torch.Tensor,
    batch: PagedPrefillBatch,
    request: int,
    first_block: int,
    block_size: int,
    descale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool blocks ``first_block ..`` of one request by gathering its tokens (any page size)."""
    kv_len = batch.host.seqlens_k[request]
    pos = torch.arange(first_block * block_size, kv_len, device=cache.device)
    pages = batch.page_table[request].long()[pos // batch.page_size]
    tokens = cache[pages, pos % batch.page_size].float()
    if descale is not None:
        tokens = tokens * descale[request][None, :, None]
    return pool_request(tokens, block_size)


def pool_chunk(
    states: Sequence[ChunkedPrefillState],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    batch: PagedPrefillBatch,
    *,
    block_size: int,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    use_triton: bool = False,
    copy_tile_pages: bool = False,
) -> ChunkStatistics:
    """Pool the blocks the chunk batch touches, store them in the states, return the batch's statistics.

    Args:
        states: one state per request of ``batch``, in batch order.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys (the chunk's KV already written).
        v_cache: paged values, or None to pool keys only.
        batch: the chunk batch (``seqlens_k`` = KV length after the chunk, prefix included).
        block_size: tokens per block (the selection's block size).
        k_descale: ``(B, Hkv) float32`` FP8 key descales, or None.
        v_descale: ``(B, Hkv) float32`` FP8 value descales, or None.
        use_triton: pool with the fused Triton kernel (CUDA, or the Triton interpreter).
        copy_tile_pages: also fill the request's carried tile pages
            (:func:`~.chunked_tile_pages.reserve_tile_pages`) in the pooling launch, when it can: one
            request with pages, values pooled, the Triton kernel, 128-token blocks, and pooling that starts
            where the pages' copy must (the same partial block). Else nothing is copied here.

    Returns:
        :class:`ChunkStatistics`: statistics of every block of every request of
        the batch (views of the state's buffers for a one-request batch, a
        concatenation otherwise), the number of blocks pooled and whether the
        tile pages were filled.

    Raises:
        TypeError: ``states`` holds something other than :class:`ChunkedPrefillState`.
        ValueError: wrong number of states, a state with another block size, or a
            chunk that does not belong to its state's prefill.
    """
    check_chunk_states(states, batch, block_size)
    host = batch.host
    first_blocks = [s.first_touched_block(p) for s, p in zip(states, host.prefix)]
    end_blocks = [num_key_blocks(kv, block_size) for kv in host.seqlens_k]
    pooled_blocks = sum(e - f for f, e in zip(first_blocks, end_blocks))
    paged = all(j * block_size % batch.page_size == 0 for j in first_blocks)
    tile_state = None
    if copy_tile_pages and paged and pooled_blocks and use_triton and v_cache is not None:
        tile_state = _fusable_tile_state(states, first_blocks[0], host.prefix[0], block_size)

    offsets_on_device = None  # the statistics' block offsets, when they rode the pooling's copy
    if pooled_blocks == 0:  # nothing to pool in any request (empty chunks ending on block boundaries)
        for b, state in enumerate(states):
            state.store(first_blocks[b], k_cache.new_zeros(0, *k_cache.shape[2:]), None, None, host.seqlens_k[b])
    elif paged:
        # The chunk batch's statistics offsets (every block of each request, from the states) ride the touched
        # batch's host-to-device copy: one copy a chunk less.
        statistics_offsets = [0, *itertools.accumulate(end_blocks)]
        touched, offsets_on_device = _pool_touched_paged(
            k_cache,
            v_cache,
            batch,
            first_blocks,
            block_size=block_size,
            k_descale=k_descale,
            v_descale=v_descale,
            use_triton=use_triton,
            tile_state=tile_state,
            trailing=statistics_offsets,
        )
        if tile_state is not None:
            tile_state.tile_tokens = host.seqlens_k[0]
        offsets = [0, *itertools.accumulate(e - f for f, e in zip(first_blocks, end_blocks))]
        for b, state in enumerate(states):
            rows = slice(offsets[b], offsets[b + 1])
            pooled_v = touched.pooled_v[rows] if touched.pooled_v is not None else None
            state.store(
                first_blocks[b], touched.pooled_k[rows], pooled_v, touched.block_lengths[rows], host.seqlens_k[b]
            )
    else:
        for b, state in enumerate(states):
            pk, lengths = _pool_touched_gather(k_cache, batch, b, first_blocks[b], block_size, k_descale)
            pv = None
            if v_cache is not None:
                pv = _pool_touched_gather(v_cache, batch, b, first_blocks[b], block_size, v_descale)[0]
            state.store(first_blocks[b], pk, pv, lengths, host.seqlens_k[b])
    statistics = batch_statistics(states, batch, block_size, block_offsets=offsets_on_device)
    return ChunkStatistics(statistics, pooled_blocks, tile_state is not None)


def check_chunk_states(states: Sequence[ChunkedPrefillState], batch: PagedPrefillBatch, block_size: int) -> None:
    """Check that ``states`` holds one state per request of the chunk batch, each owning its request's chunk.

    Args:
        states: the chunk's request states, in batch order.
        batch: the chunk batch.
        block_size: tokens per block of the selection.

    Raises:
        TypeError: ``states`` holds something other than :class:`ChunkedPrefillState`.
        ValueError: wrong number of states, a state with another block size, or a
            chunk that does not belong to its state's prefill.
    """
    if len(states) != batch.num_requests:
        raise ValueError(
            f"states must hold one ChunkedPrefillState per request ({batch.num_requests}); got {len(states)}"
        )
    for b, state in enumerate(states):
        if not isinstance(state, ChunkedPrefillState):
            raise TypeError(f"states[{b}] must be a ChunkedPrefillState, got {type(state).__name__}")
        if state.block_size != block_size:
            raise ValueError(f"states[{b}] pools blocks of {state.block_size} tokens, the selection uses {block_size}")
    for state, prefix, q_len in zip(states, batch.host.prefix, batch.host.q_lens):
        state.check_chunk(prefix, q_len)


def _fusable_tile_state(
    states: Sequence[ChunkedPrefillState], first_block: int, prefix: int, block_size: int
) -> ChunkedPrefillState | None:
    """The one state whose tile pages the pooling launch can fill: its copy starts at the pooling's first block."""
    if len(states) != 1 or block_size != TILE_TOKENS:
        return None
    state = states[0]
    if state.tile_k is None or state.tile_v is None:
        return None
    # The carried copy rewrites from the page holding the first token it lacks (the partial page included).
    return state if min(state.tile_tokens, prefix) // TILE_TOKENS == first_block else None


def batch_statistics(
    states: Sequence[ChunkedPrefillState],
    batch: PagedPrefillBatch,
    block_size: int,
    *,
    block_offsets: torch.Tensor | None = None,
) -> BlockStatistics:
    """The :class:`BlockStatistics` of a chunk batch, read from its requests' states.

    Args:
        states: one state per request, each pooled up to its request's ``seqlens_k``.
        batch: the chunk batch.
        block_size: tokens per block.
        block_offsets: the statistics' ``(B + 1,) int32`` block offsets already on the device (the
            states' block counts, accumulated), or None to copy them here.

    Returns:
        The statistics (views of the state's buffers when the batch has one request).

    Raises:
        ValueError: a state does not cover its request's KV.
    """
    parts_k, parts_v, parts_len, counts = [], [], [], []
    for b, (state, kv_len) in enumerate(zip(states, batch.host.seqlens_k)):
        if state.num_tokens != kv_len:
            raise ValueError(f"states[{b}] covers {state.num_tokens} KV tokens, the batch has seqlens_k={kv_len}")
        pk, pv, lengths = state.statistics_rows()
        parts_k.append(pk)
        parts_v.append(pv)
        parts_len.append(lengths)
        counts.append(pk.shape[0])
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    with_values = all(v is not None for v in parts_v)
    if len(states) == 1:
        pooled_k, pooled_v, lengths = parts_k[0], parts_v[0] if with_values else None, parts_len[0]
    else:
        pooled_k = torch.cat(parts_k)
        pooled_v = torch.cat(parts_v) if with_values else None  # type: ignore[arg-type]
        lengths = torch.cat(parts_len)
    return BlockStatistics(
        pooled_k=pooled_k,
        pooled_v=pooled_v,
        block_lengths=lengths,
        block_offsets=device_ints(offsets, batch.device) if block_offsets is None else block_offsets,
        block_size=block_size,
    )
