"""Tile pages carried across the chunks of a chunked prefill.

On pages that are not a multiple of its 128-token KV tile (page size 1 is
SGLang's default) the Hopper kernel either gathers K/V rows with cp.async or
runs its TMA path on a copy of the call's K/V in 128-token tile pages
(:mod:`.tile_repack_policy`). A chunk of a chunked prefill reads the whole
prefix, so a copy made per call rewrites the prefix at every chunk: over a
128K prompt in 8K chunks that is about 8.5 copies of the prompt, the chunk-aware
pipeline's attention then ran 6% slower than the per-chunk pipeline's at 8%
fewer kept blocks (H100, ``benchmarks/results/2026-12-06-h100-chunk-tile-pages``).

Here the request's :class:`~.chunked_state.ChunkedPrefillState` keeps one copy
of its whole prompt in tile pages (allocated at its first chunk, sized by
``prompt_len``) and each chunk copies only the pages it touches: the previous
partial page and its own. The chunk's attention reads that copy through a page
table of the tile pages (``tile_copies`` of the backend's ``run``). The pages
are released once the prompt's last chunk has been launched
(:func:`release_finished_tile_pages`).

Carried for one-request chunk batches whose state knows ``prompt_len``, when
the backend says the copy pays (``carries_tile_pages``); other calls keep the
backend's per-call rule. The pages are allocated before the chunk's pooling
(:func:`reserve_tile_pages`) so that the fused Triton pooling kernel fills the
pages the chunk touches in its own launch, reading the chunk's tokens once;
where it cannot (the reference pooling, page sizes it gathers from), the copy is
a launch of its own.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.contracts import cdiv

from .chunked_pooling import TILE_TOKENS, batch_from_host
from .chunked_state import ChunkedPrefillState

if TYPE_CHECKING:
    from fpv2.kernel.triton.tile_repack import TileRepacked


#: ``0`` leaves the carried copy to a launch of its own, ``1`` (the default) lets the pooling launch make it.
FUSED_COPY_ENV = "FPV2_CHUNKED_FUSED_TILE_COPY"


def fused_tile_copy() -> bool:
    """Whether the chunk's pooling launch fills the carried tile pages (``FPV2_CHUNKED_FUSED_TILE_COPY``).

    Returns:
        False for ``0``, True for ``1`` or unset.

    Raises:
        ValueError: any other value, naming the variable.
    """
    value = os.environ.get(FUSED_COPY_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{FUSED_COPY_ENV} must be 0 or 1; got {value!r}")
    return value == "1"


def reserve_tile_pages(
    backend: object,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    states: Sequence[ChunkedPrefillState],
) -> bool:
    """Allocate the request's tile pages at its first chunk when the backend says they pay.

    Called before the chunk's pooling, so that the pooling kernel can fill the chunk's pages in the same
    launch (:func:`fpv2.serving.chunked_pooling.pool_chunk` with ``copy_tile_pages``).

    Args:
        backend: the attention backend (asked through ``carries_tile_pages`` before the first copy).
        q: the chunk's queries.
        k_cache: paged keys of the whole prompt.
        batch: the chunk batch.
        states: the chunk's request states, in batch order.

    Returns:
        True when the chunk's request carries tile pages (allocated now or at an earlier chunk).
    """
    if batch.num_requests != 1 or len(states) != 1 or states[0].prompt_len is None:
        return False
    state = states[0]
    if state.tile_k is not None:
        return True
    carries = getattr(backend, "carries_tile_pages", None)
    if not callable(carries):
        return False
    _, _, num_kv_heads, head_dim = k_cache.shape
    pages = max(cdiv(state.prompt_len, TILE_TOKENS), 1)
    copy_bytes = 2 * pages * TILE_TOKENS * num_kv_heads * head_dim * k_cache.element_size()
    if not carries(q, k_cache, batch, copy_bytes):
        return False
    shape = (pages, TILE_TOKENS, num_kv_heads, head_dim)
    state.tile_k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    state.tile_v = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
    state.tile_table = torch.arange(pages, dtype=torch.int32, device=k_cache.device)[None, :]
    state.tile_tokens = 0
    return True


def carried_tile_copies(
    backend: object,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    states: Sequence[ChunkedPrefillState],
    *,
    copied: bool = False,
) -> TileRepacked | None:
    """Bring the request's tile pages up to the chunk's KV and return them for the attention call.

    Args:
        backend: the attention backend (asked through ``carries_tile_pages`` before the first copy).
        q: the chunk's queries.
        k_cache: paged keys of the whole prompt (the chunk's KV already written).
        v_cache: paged values.
        batch: the chunk batch (one request: ``seqlens_k`` = KV length after the chunk).
        states: the chunk's request states, in batch order.
        copied: the chunk's pooling already filled the pages it touches (``ChunkStatistics.tile_pages_copied``);
            nothing is copied then.

    Returns:
        :class:`fpv2.kernel.triton.tile_repack.TileRepacked` over the state's tile pages, with a batch of
        the chunk's query offsets and KV lengths that addresses them; None when no copy is carried.
    """
    if not reserve_tile_pages(backend, q, k_cache, batch, states):
        return None
    state = states[0]
    kv_len = batch.host.seqlens_k[0]
    if not copied:
        _copy_touched_pages(state, k_cache, v_cache, batch, kv_len)
    elif state.tile_tokens != kv_len:
        raise RuntimeError(
            f"the chunk's pooling was said to fill the tile pages up to {kv_len} tokens; they hold {state.tile_tokens}"
        )
    tiles = PagedPrefillBatch(
        cu_seqlens_q=batch.cu_seqlens_q,
        seqlens_k=batch.seqlens_k,
        page_table=state.tile_table,
        page_size=TILE_TOKENS,
        num_pages=state.tile_k.shape[0],
        check_values=False,
    )
    tiles.assume_host_view(batch.host)
    from fpv2.kernel.triton.tile_repack import TileRepacked  # imports triton: only once a copy exists

    return TileRepacked(state.tile_k, state.tile_v, tiles)


def _copy_touched_pages(
    state: ChunkedPrefillState, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch, kv_len: int
) -> None:
    """Copy tile pages ``first ..`` up to ``kv_len`` tokens; earlier pages already hold their tokens."""
    from fpv2.kernel.triton.tile_repack import repack_into_tile_pages

    prefix = batch.host.prefix[0]
    first = min(state.tile_tokens, prefix) // TILE_TOKENS  # the partial last page is copied again
    if first * TILE_TOKENS % batch.page_size:
        first = 0  # the first page to rewrite starts inside a cache page: copy from the start
    start = first * TILE_TOKENS // batch.page_size
    table = batch.page_table[:, start:] if start < batch.page_table.shape[1] else batch.page_table[:, :1]
    touched = batch_from_host(
        [0], [kv_len - first * TILE_TOKENS], table, page_size=batch.page_size, num_pages=batch.num_pages
    )
    repack_into_tile_pages(k_cache, v_cache, touched, state.tile_k[first:], state.tile_v[first:])
    state.tile_tokens = kv_len


def release_finished_tile_pages(states: Sequence[ChunkedPrefillState]) -> None:
    """Drop the tile pages of states whose whole prompt has been prefilled (called after the chunk's launch).

    The attention call that read them is queued on the current stream, which the caching allocator orders
    the memory's reuse after. A retried last chunk copies the prompt again.

    Args:
        states: the chunk's request states.
    """
    for state in states:
        if state.tile_k is not None and state.prompt_len is not None and state.tile_tokens >= state.prompt_len:
            state.tile_k = state.tile_v = state.tile_table = None
            state.tile_tokens = 0
