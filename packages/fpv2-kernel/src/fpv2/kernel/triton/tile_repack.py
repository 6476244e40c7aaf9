"""Tile repacking: a batch's K and V copied from small pages into pages of one 128-token KV tile.

The Hopper kernel loads K/V tiles by TMA when the page size is a multiple of its
128-token tile and gathers them row by row with cp.async otherwise (page size 1
included). On the H200 the gather runs dense 32K at 17.2 ms against 13.0 ms for
TMA at page 128 (``benchmarks/NOTES.md``, 2026-12-03): the L2 serves its per-row
requests at a lower rate, and one-row TMA copies measured slower still. A
prefill call reads each key block once per query tile that keeps it, so when its
queries are a large share of its keys, copying the batch's keys and values once
into tile-sized pages (one read and one write of the batch's KV) and running the
TMA path costs less than gathering every kept block for every tile.

The copy keeps every request's token order: token ``t`` of request ``b`` goes to
row ``t % 128`` of tile page ``first_page[b] + t // 128``, where requests take
consecutive tile pages in batch order. Rows past a request's KV length are
zero-filled, so the kernel never reads stale values there. The copy runs on the
device without a host synchronisation (its grid comes from the batch's cached
host view).

The tile batch (its page table and metadata) depends only on the batch's
lengths, so it is made once per batch and kept on it, like the batch's host
view: every layer of a forward pass copies its own K/V with the same batch and
gets the same tile batch back (the C-ABI description of that batch is then
built once too). The copy kernel rewrites the table's entries on every call
(the same values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..contracts import PagedPrefillBatch
from .interpreter_compat import install_interpreter_index_fix
from .relaunch import Relauncher

#: Tokens per tile page (the Hopper kernel's KV tile and the index's key block).
TILE_TOKENS = 128
#: Tokens one program copies, and its warps (defaults; ``benchmarks/tile_repack_speed.py --sweep`` times others).
TOKENS_PER_PROGRAM = 16
NUM_WARPS = 4


@triton.jit
def tile_repack_kernel(
    KSrc,
    VSrc,
    KDst,
    VDst,
    PageTable,
    page_table_stride,
    SeqlensK,
    TileTable,
    tile_table_stride,
    num_requests,
    page_size,
    k_page_stride,
    k_token_stride,
    k_head_stride,
    v_page_stride,
    v_token_stride,
    v_head_stride,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    ROW_P2: tl.constexpr,
    TILE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """Tokens ``part * TOKENS ..`` of tile page ``pid``: ``ROW`` = Hkv * d elements a token, zeros past the request.

    The first program of each tile page also writes its entry of the tile page table (request ``b``'s page
    ``j`` is tile page ``first[b] + j``), so the host launches nothing else.
    """
    pid = tl.program_id(0)
    part = tl.program_id(1)
    # Request b owns tile pages first .. first + ceil(seqlens_k[b] / TILE) - 1, after the earlier requests'.
    b = pid * 0
    first = pid * 0
    end = pid * 0  # tile pages of requests 0 .. i
    for i in range(num_requests):
        end += (tl.load(SeqlensK + i) + TILE - 1) // TILE
        past = pid >= end
        b += past.to(tl.int32)
        first = tl.where(past, end, first)
    kv_len = tl.load(SeqlensK + b)
    if part == 0:
        tl.store(TileTable + b.to(tl.int64) * tile_table_stride + (pid - first), pid)
    local = part * TOKENS + tl.arange(0, TOKENS)
    token = (pid - first) * TILE + local
    valid = token < kv_len
    page = tl.load(PageTable + b.to(tl.int64) * page_table_stride + token // page_size, mask=valid, other=0)
    page = page.to(tl.int64)
    slot = (token % page_size).to(tl.int64)
    cols = tl.arange(0, ROW_P2)
    in_row = cols < ROW
    load_mask = valid[:, None] & in_row[None, :]
    dst = (pid.to(tl.int64) * TILE + local)[:, None] * ROW + cols[None, :]
    # Element (head, e) of a token sits at head * head_stride + e in the source (d when its rows are dense).
    head = cols // HEAD_DIM
    within = cols % HEAD_DIM
    k_row = page * k_page_stride + slot * k_token_stride
    k_cols = head.to(tl.int64) * k_head_stride + within
    k = tl.load(KSrc + k_row[:, None] + k_cols[None, :], mask=load_mask, other=0.0)
    tl.store(KDst + dst, k, mask=in_row[None, :])
    v_row = page * v_page_stride + slot * v_token_stride
    v_cols = head.to(tl.int64) * v_head_stride + within
    v = tl.load(VSrc + v_row[:, None] + v_cols[None, :], mask=load_mask, other=0.0)
    tl.store(VDst + dst, v, mask=in_row[None, :])


#: The copy's launcher: after the first launch at a shape, later ones skip ``JITFunction.run`` (:mod:`.relaunch`).
_REPACK = Relauncher(tile_repack_kernel)


@dataclass(frozen=True)
class TileRepacked:
    """A batch's K and V in tile pages, with the batch that addresses them.

    Attributes:
        k_cache: ``(num_tile_pages, 128, Hkv, d)`` keys, contiguous.
        v_cache: values, same shape.
        batch: the input batch's query offsets and KV lengths (the same tensors)
            with a page table of the tile pages and ``page_size`` 128.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    batch: PagedPrefillBatch


def tile_pages_per_request(batch: PagedPrefillBatch) -> list[int]:
    """Tile pages each request takes, ``ceil(seqlens_k[b] / 128)``, from the batch's host view."""
    return [-(-length // TILE_TOKENS) for length in batch.host.seqlens_k]


def tile_repack_bytes(k_cache: torch.Tensor, batch: PagedPrefillBatch) -> int:
    """Bytes :func:`repack_to_tile_pages` allocates for the copies of K and V (host view, no device read).

    Args:
        k_cache: the paged keys ``(num_pages, page_size, Hkv, d)``.
        batch: the batch metadata.

    Returns:
        ``2 * num_tile_pages * 128 * Hkv * d * element size``.
    """
    _, _, num_kv_heads, head_dim = k_cache.shape
    return 2 * sum(tile_pages_per_request(batch)) * TILE_TOKENS * num_kv_heads * head_dim * k_cache.element_size()


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch) -> None:
    """The caches a copy into tile pages reads: 4-D, on the batch's device, unit element stride, same shape."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(cache).__name__}")
        if cache.dim() != 4:
            raise ValueError(f"{name} must be (num_pages, page_size, Hkv, d); got shape {tuple(cache.shape)}")
        if cache.device != batch.device:
            raise ValueError(f"{name} is on {cache.device}, the batch on {batch.device}")
        if cache.stride(3) != 1:
            raise ValueError(
                f"{name}: the copy reads each head's d values as one run and needs element stride 1; got strides "
                f"{tuple(cache.stride())} for shape {tuple(cache.shape)}"
            )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"v_cache must match k_cache: got {tuple(v_cache.shape)} {v_cache.dtype} against "
            f"{tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k_cache.shape[1] != batch.page_size:
        raise ValueError(f"k_cache has pages of {k_cache.shape[1]} tokens, the batch says page_size={batch.page_size}")


def allocate_tile_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch) -> TileRepacked:
    """Uninitialised tile pages for the batch's K and V, and the batch that addresses them.

    For a producer other than :func:`repack_to_tile_pages` that writes the same copies as it reads the cache
    (``fpv2.index.triton.pool_blocks_triton(..., tile_copies=...)`` writes them while pooling): it must write
    every row of every tile page (zeros past a request's KV length) and the tile batch's page table
    (request ``b``'s page ``j`` is tile page ``first[b] + j``) before the copies are read.

    Args:
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys (element stride 1).
        v_cache: paged values, same shape and dtype.
        batch: the batch metadata.

    Returns:
        :class:`TileRepacked` with ``(num_tile_pages, 128, Hkv, d)`` contiguous K and V of the caches' dtype.

    Raises:
        TypeError, ValueError: as :func:`repack_to_tile_pages`.
    """
    _check_caches(k_cache, v_cache, batch)
    _, _, num_kv_heads, head_dim = k_cache.shape
    repacked = tile_batch(batch)
    # Two allocations: one of both halves measured slower on the device's host (91-104 against 39-52 us for the
    # whole function, benchmarks/results/2026-12-04-h200-pooled-copy/host*).
    shape = (repacked.num_pages, TILE_TOKENS, num_kv_heads, head_dim)
    k_tiles = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    v_tiles = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    return TileRepacked(k_tiles, v_tiles, repacked)


def repack_to_tile_pages(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    tokens_per_program: int = TOKENS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
) -> TileRepacked:
    """Copy the batch's keys and values into 128-token pages (see the module docstring).

    Args:
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys on a CUDA device (or the CPU under
            the Triton interpreter); the element stride must be 1, page, token and head strides are
            free (for example vLLM's K and V views of its one per-layer buffer, head stride ``2 d`` or
            ``block_size * 2 d``).
        v_cache: paged values, same shape and dtype.
        batch: the batch metadata (its host view gives the grid: one sync on first use, cached).
        tokens_per_program: tokens one program copies (a power of two dividing 128).
        num_warps: warps per program.

    Returns:
        The :class:`TileRepacked` copies and batch.

    Raises:
        TypeError: the caches are not tensors or differ in dtype.
        ValueError: shapes or strides the copy cannot read, caches on another device than the batch, or
            ``tokens_per_program`` not a power of two dividing 128.
    """
    _check_launch(k_cache, v_cache, batch, tokens_per_program)
    packed = allocate_tile_pages(k_cache, v_cache, batch)
    _launch_repack(k_cache, v_cache, batch, packed, tokens_per_program, num_warps)
    return packed


def repack_into_tile_pages(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    k_tiles: torch.Tensor,
    v_tiles: torch.Tensor,
    *,
    tokens_per_program: int = TOKENS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
) -> TileRepacked:
    """:func:`repack_to_tile_pages` into tile pages the caller owns.

    For a copy kept across calls: a chunked prefill copies only the tokens each chunk adds, into tile
    pages that hold the whole prompt, by passing views that start at the first page it rewrites
    (``k_tiles[first_page:]``). Request ``b``'s page ``j`` goes to page ``first[b] + j`` of the views,
    in batch order, as in :func:`repack_to_tile_pages`; rows past a request's KV length are zeroed.

    Args:
        k_cache: paged keys, as for :func:`repack_to_tile_pages`.
        v_cache: paged values, same shape and dtype.
        batch: the batch metadata.
        k_tiles: ``(n, 128, Hkv, d)`` contiguous destination for the keys, with ``n`` at least
            ``sum(tile_pages_per_request(batch))``; same dtype and device as ``k_cache``.
        v_tiles: the destination for the values, same shape.
        tokens_per_program: tokens one program copies (a power of two dividing 128).
        num_warps: warps per program.

    Returns:
        :class:`TileRepacked` over ``k_tiles`` and ``v_tiles``.

    Raises:
        TypeError: as :func:`repack_to_tile_pages`, or destinations of another dtype.
        ValueError: as :func:`repack_to_tile_pages`, or destinations of another shape, device or
            layout, or with too few pages.
    """
    _check_launch(k_cache, v_cache, batch, tokens_per_program)
    _, _, num_kv_heads, head_dim = k_cache.shape
    pages = sum(tile_pages_per_request(batch))
    for name, tiles in (("k_tiles", k_tiles), ("v_tiles", v_tiles)):
        if not isinstance(tiles, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(tiles).__name__}")
        if tiles.dtype != k_cache.dtype:
            raise TypeError(f"{name} must have the caches' dtype {k_cache.dtype}; got {tiles.dtype}")
        if tiles.dim() != 4 or tuple(tiles.shape[1:]) != (TILE_TOKENS, num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be (n, {TILE_TOKENS}, {num_kv_heads}, {head_dim}); got shape {tuple(tiles.shape)}"
            )
        if tiles.shape[0] < pages:
            raise ValueError(f"{name} holds {tiles.shape[0]} tile pages; the batch needs {pages}")
        if tiles.device != k_cache.device or not tiles.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {k_cache.device}; got {tiles.device}")
    packed = TileRepacked(k_tiles, v_tiles, tile_batch(batch))
    _launch_repack(k_cache, v_cache, batch, packed, tokens_per_program, num_warps)
    return packed


def _check_launch(k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch, tokens: int) -> None:
    """The checks of a copy launch: program size, caches, and the CPU only under the interpreter."""
    if tokens <= 0 or TILE_TOKENS % tokens or tokens & (tokens - 1):
        raise ValueError(f"tokens_per_program must be a power of two dividing {TILE_TOKENS}; got {tokens}")
    _check_caches(k_cache, v_cache, batch)
    if k_cache.device.type == "cpu":
        if not isinstance(tile_repack_kernel, InterpretedFunction):
            raise ValueError(
                "the tile repack needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run on "
                "the CPU; got caches on the CPU"
            )
        install_interpreter_index_fix()


def _launch_repack(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    packed: TileRepacked,
    tokens_per_program: int,
    num_warps: int,
) -> None:
    """One launch of the copy kernel into ``packed`` (its pages and its batch's page table)."""
    pages = sum(tile_pages_per_request(batch))
    if pages == 0:  # no tile page has a token: the grid would be empty
        return
    _, _, num_kv_heads, head_dim = k_cache.shape
    table = packed.batch.page_table
    row = num_kv_heads * head_dim
    _REPACK(
        (pages, TILE_TOKENS // tokens_per_program),
        k_cache,
        v_cache,
        packed.k_cache,
        packed.v_cache,
        batch.page_table,
        batch.page_table.stride(0),
        batch.seqlens_k,
        table,
        table.stride(0),
        batch.num_requests,
        batch.page_size,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=head_dim,
        ROW=row,
        ROW_P2=triton.next_power_of_2(row),
        TILE=TILE_TOKENS,
        TOKENS=tokens_per_program,
        num_warps=num_warps,
    )


#: Key of the tile batch in a batch's instance dict (frozen dataclasses allow such entries, as ``host``).
_TILE_BATCH_KEY = "_fpv2_tile_batch"


def tile_batch(batch: PagedPrefillBatch) -> PagedPrefillBatch:
    """The batch that addresses ``batch``'s tile pages, made on first use and kept on ``batch``.

    Its query offsets and KV lengths are ``batch``'s own tensors and host view; its page table
    (``(B, max pages) int32`` on the batch's device) is filled by the copy kernel on each call
    (request ``b`` owns tile pages ``first[b] ..``, after the earlier requests'). The cache is
    rebuilt when the batch's tensors' data pointers differ from the ones it was made for.

    Args:
        batch: the source batch.

    Returns:
        A :class:`PagedPrefillBatch` with ``page_size`` 128 and at least one page.
    """
    pointers = (batch.cu_seqlens_q.data_ptr(), batch.seqlens_k.data_ptr(), batch.page_table.data_ptr())
    cached = batch.__dict__.get(_TILE_BATCH_KEY)
    if cached is not None and cached[0] == pointers:
        return cached[1]
    pages = tile_pages_per_request(batch)
    # Entries past a request's last tile page are never read (the batch contract): the kernel writes the rest.
    table = torch.empty((batch.num_requests, max(max(pages, default=0), 1)), dtype=torch.int32, device=batch.device)
    repacked = PagedPrefillBatch(
        cu_seqlens_q=batch.cu_seqlens_q,
        seqlens_k=batch.seqlens_k,
        page_table=table,
        page_size=TILE_TOKENS,
        num_pages=max(sum(pages), 1),
        check_values=False,
    )
    repacked.assume_host_view(batch.host)
    batch.__dict__[_TILE_BATCH_KEY] = (pointers, repacked)
    return repacked
