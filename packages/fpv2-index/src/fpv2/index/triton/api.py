"""Public entry points of the fused Triton index stage: pooling, then scoring + selection + compaction.

Host-side data: both functions size their outputs and grids from
``batch.host`` (the batch's cached host copy of ``cu_seqlens_q`` and
``seqlens_k``, read once per batch) and never read device values otherwise.
:func:`select_blocks_triton` makes no host sync by default: ``blocks`` is sized
by an upper bound on the causally visible pairs (:func:`capacity_bound`) and
the :class:`~fpv2.kernel.BlockIndex` contract lets it carry that spare
capacity; ``exact_nnz=True`` trims it at the price of one 4-byte read of
``offsets[-1]``.

Launches: pooling is one kernel (it writes ``block_offsets`` and the scoring
copy of the pooled keys too, :mod:`.prepared_keys`); selection is two: the
fused scoring/selection kernel (which also writes ``tile_offsets`` and all of
``offsets``, its last program scanning the counts) and the compaction. A third
one, the key preparation, runs only when the statistics carry no matching
scoring copy (another softmax scale or query dtype than pooling expected, or
statistics not pooled by :func:`pool_blocks_triton`). Nothing is zero-filled.
Launches go through :class:`~fpv2.kernel.triton.relaunch.Relauncher`, which relaunches a
compiled kernel without ``JITFunction.run``'s per-call bookkeeping.

Memory: each function's outputs are fresh tensors on every call (callers keep
statistics and indices across calls, so nothing returned is ever overwritten
by a later call), carved from one allocation per call (:mod:`.outputs`);
scratch comes from the :class:`IndexWorkspace`, which a repeated call at the
same shape reuses without allocating.

Both run on CUDA tensors, or on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``, for tests).
"""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import (
    ACTIVATION_DTYPES,
    SUPPORTED_HEAD_DIMS,
    BlockIndex,
    BlockStatistics,
    PagedPrefillBatch,
    num_key_blocks,
    num_query_tiles,
)
from fpv2.kernel.triton.relaunch import interpreter_enabled
from fpv2.kernel.triton.tile_repack import TILE_TOKENS, TileRepacked, tile_pages_per_request

from ..config import SelectionConfig
from . import tuning
from .compaction import launch_compact
from .hopper_scoring import use_hopper_scoring
from .outputs import fresh_outputs
from .pooling import launch_pool
from .prepared_keys import (
    DOT_DTYPES,
    PooledCopies,
    PreparedKeys,
    TritonBlockStatistics,
    dot_kind,
    logit_scale_log2,
    matching_keys,
    version_of,
)
from .scoring import launch_prepare_keys, launch_score_select, num_units, score_rows
from .workspace import IndexWorkspace, WorkspaceViews

__all__ = ["capacity_bound", "interpreter_enabled", "pool_blocks_triton", "select_blocks_triton"]


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_device(name: str, t: torch.Tensor) -> None:
    """Triton needs CUDA tensors, or the interpreter for CPU tensors."""
    if t.device.type == "cuda" or interpreter_enabled():
        return
    raise ValueError(
        f"{name} is on {t.device}: the Triton index stage needs CUDA tensors (or TRITON_INTERPRET=1 to run on "
        f"the CPU interpreter); got {_describe(t)}"
    )


def _check_batch(batch: object) -> PagedPrefillBatch:
    if not isinstance(batch, PagedPrefillBatch):
        raise TypeError(f"batch must be a PagedPrefillBatch, got {type(batch).__name__}")
    return batch


def _check_descale(
    name: str, scale: object, *, needed: bool, fp8: bool, batch: PagedPrefillBatch, num_kv_heads: int
) -> torch.Tensor | None:
    """FP8 descales: ``(B, Hkv) float32`` on the batch's device, required with FP8 inputs, refused otherwise."""
    if scale is None:
        if needed:
            raise ValueError(
                f"{name} is required for float8_e4m3fn inputs (shape ({batch.num_requests}, {num_kv_heads}))"
            )
        return None
    if not fp8:
        raise ValueError(f"{name} is only meaningful for float8_e4m3fn inputs")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        got = _describe(scale) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name} must be a float32 tensor of shape ({batch.num_requests}, {num_kv_heads}); got {got}")
    if tuple(scale.shape) != (batch.num_requests, num_kv_heads) or scale.device != batch.device:
        raise ValueError(
            f"{name} must have shape ({batch.num_requests}, {num_kv_heads}) on {batch.device}; got {_describe(scale)}"
        )
    return scale.contiguous()


def _check_cache(name: str, cache: object, batch: PagedPrefillBatch) -> torch.Tensor:
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"{name} must have dtype in {ACTIVATION_DTYPES}; got {_describe(cache)}")
    if cache.dim() != 4 or cache.shape[0] != batch.num_pages or cache.shape[1] != batch.page_size:
        raise ValueError(
            f"{name} must have shape (num_pages={batch.num_pages}, page_size={batch.page_size}, Hkv, d); "
            f"got {_describe(cache)}"
        )
    if cache.device != batch.device:
        raise ValueError(f"{name} must be on the batch's device {batch.device}; got {_describe(cache)}")
    if cache.numel() and cache.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in d; got strides {tuple(cache.stride())} ({_describe(cache)})")
    _check_device(name, cache)
    return cache


def pool_blocks_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    batch: PagedPrefillBatch,
    *,
    block_size: int = 128,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    query_dtype: torch.dtype | None = None,
    softmax_scale: float | None = None,
    pooled_copy_dtype: torch.dtype | None = None,
    tile_copies: TileRepacked | None = None,
) -> TritonBlockStatistics:
    """Mean-pool every key block (and value block) of every request, straight from the paged cache.

    Block ``J`` of request ``b`` averages its valid tokens (the tail block over
    its real length), accumulated in fp32, after the FP8 descale of its
    (request, KV head). Same result as :func:`fpv2.kernel.reference.pooling.pool_blocks`.
    One kernel launch (it also writes ``block_offsets`` and the scoring copy of the keys);
    no host sync beyond ``batch.host``. The outputs are fresh tensors sharing one allocation.

    The scoring copy (:mod:`.prepared_keys`) is what :func:`select_blocks_triton`
    would otherwise compute in a launch of its own, made for a selection with
    ``softmax_scale`` and queries of ``query_dtype``; a selection with other
    values prepares its own keys (same index either way).

    With ``pooled_copy_dtype=torch.bfloat16`` the same launch also writes bf16 copies of
    ``pooled_k`` and ``pooled_v`` (:class:`~.prepared_keys.PooledCopies`: the stored fp32
    means rounded to nearest even, what ``.to(torch.bfloat16)`` makes of them), which the
    Hopper kernel's binding then hands over instead of converting the means on every call.

    With ``tile_copies`` (from :func:`fpv2.kernel.triton.tile_repack.allocate_tile_pages` for the same
    caches and batch) the same launch also copies every token of K and V into those tile pages and writes
    their page table: what :func:`~fpv2.kernel.triton.tile_repack.repack_to_tile_pages` makes in a launch
    (and a read of the caches) of its own. Needs ``v_cache`` and ``block_size = 128``.

    Args:
        k_cache: ``(num_pages, page_size, Hkv, d)`` key cache (fp16, bf16, fp32 or float8_e4m3fn).
        v_cache: value cache of the same shape and dtype, or None to pool keys only.
        batch: the paged prefill batch.
        block_size: tokens per key block (a power of two).
        k_descale: ``(B, Hkv) float32`` key descales, required for FP8 caches, refused otherwise.
        v_descale: ``(B, Hkv) float32`` value descales, required for an FP8 ``v_cache``.
        query_dtype: dtype of the queries the selection will score (None: the cache's dtype).
        softmax_scale: the selection's ``SelectionConfig.softmax_scale`` (None: ``1 / sqrt(d)``).
        pooled_copy_dtype: ``torch.bfloat16`` to also write bf16 copies of the pooled K and V; None
            (the default) for none.
        tile_copies: tile pages to fill with the batch's K and V, or None (the default).

    Returns:
        :class:`~.prepared_keys.TritonBlockStatistics` (a :class:`~fpv2.kernel.BlockStatistics`) with
        ``pooled_k`` (and ``pooled_v``) of shape ``(total_blocks, Hkv, d) float32``, ``block_lengths``,
        ``block_offsets``, ``block_size``, the scoring copy in ``prepared_keys`` and the bf16 copies, if
        asked for, in ``pooled_copies``.

    Raises:
        TypeError: an argument has the wrong type or dtype (``pooled_copy_dtype`` other than bf16 or None).
        ValueError: shapes, devices or strides disagree with the batch; the message names the argument.
    """
    batch = _check_batch(batch)
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size}")
    k_cache = _check_cache("k_cache", k_cache, batch)
    if v_cache is not None:
        v_cache = _check_cache("v_cache", v_cache, batch)
        if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"v_cache must match k_cache ({_describe(k_cache)}); got {_describe(v_cache)}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    heads = k_cache.shape[2]
    k_descale = _check_descale("k_descale", k_descale, needed=fp8, fp8=fp8, batch=batch, num_kv_heads=heads)
    v_descale = _check_descale(
        "v_descale", v_descale, needed=fp8 and v_cache is not None, fp8=fp8, batch=batch, num_kv_heads=heads
    )
    if query_dtype is None:
        query_dtype = k_cache.dtype
    elif query_dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"query_dtype must be one of {ACTIVATION_DTYPES}, got {query_dtype!r}")
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0
    ):
        raise ValueError(f"softmax_scale must be a positive float or None, got {softmax_scale!r}")
    if pooled_copy_dtype is not None and pooled_copy_dtype != torch.bfloat16:
        raise TypeError(f"pooled_copy_dtype must be torch.bfloat16 or None, got {pooled_copy_dtype!r}")
    copies = pooled_copy_dtype is not None
    if tile_copies is not None:
        _check_tile_copies(tile_copies, k_cache, v_cache, batch, block_size)
    kind = dot_kind(query_dtype, interpreter_enabled())
    key_scale = logit_scale_log2(softmax_scale, k_cache.shape[3])
    total = sum(num_key_blocks(k, block_size) for k in batch.host.seqlens_k)
    pooled_k, pooled_v, keys, k_copy, v_copy, lengths, block_offsets = launch_pool(
        k_cache,
        v_cache,
        seqlens_k=batch.seqlens_k,
        page_table=batch.page_table,
        page_size=batch.page_size,
        total_blocks=total,
        block_size=block_size,
        k_descale=k_descale,
        v_descale=v_descale if v_cache is not None else None,
        key_dtype=DOT_DTYPES[kind],
        key_scale=key_scale,
        copies=copies,
        tile_copies=tile_copies,
    )
    prepared = PreparedKeys(keys, pooled_k, version_of(pooled_k), key_scale, kind)
    pooled_copies = PooledCopies.of(k_copy, v_copy, pooled_k, pooled_v) if copies else None
    return TritonBlockStatistics(
        pooled_k, pooled_v, lengths, block_offsets, block_size, prepared_keys=prepared, pooled_copies=pooled_copies
    )


def _check_tile_copies(
    tile_copies: object, k_cache: torch.Tensor, v_cache: torch.Tensor | None, batch: PagedPrefillBatch, block_size: int
) -> None:
    """Tile pages the pooling can fill: from ``allocate_tile_pages`` for these caches and this batch."""
    if not isinstance(tile_copies, TileRepacked):
        raise TypeError(f"tile_copies must be a TileRepacked (allocate_tile_pages), got {type(tile_copies).__name__}")
    if v_cache is None:
        raise ValueError("tile_copies needs v_cache: the tile pages carry keys and values")
    if block_size != TILE_TOKENS:
        raise ValueError(f"tile_copies needs block_size={TILE_TOKENS} (a key block is a tile page); got {block_size}")
    shape = (max(sum(tile_pages_per_request(batch)), 1), TILE_TOKENS, *k_cache.shape[2:])
    for name, tiles in (("k_cache", tile_copies.k_cache), ("v_cache", tile_copies.v_cache)):
        if tuple(tiles.shape) != shape or tiles.dtype != k_cache.dtype or tiles.device != k_cache.device:
            raise ValueError(
                f"tile_copies.{name} must be {shape} {k_cache.dtype} on {k_cache.device} for this batch; got "
                f"{_describe(tiles)}"
            )
        if not tiles.is_contiguous():
            raise ValueError(f"tile_copies.{name} must be contiguous; got strides {tuple(tiles.stride())}")
    table = tile_copies.batch.page_table
    if table.shape[0] != batch.num_requests or table.device != k_cache.device or table.dtype != torch.int32:
        raise ValueError(
            f"tile_copies.batch.page_table must be ({batch.num_requests}, pages) int32 on {k_cache.device}; got "
            f"{_describe(table)}"
        )


def _check_selection(
    q: object,
    batch: PagedPrefillBatch,
    statistics: object,
    config: object,
    q_descale: object,
    k_descale: object,
) -> tuple[torch.Tensor, BlockStatistics, SelectionConfig, torch.Tensor | None]:
    """Shape-level checks of :func:`select_blocks_triton` (no device values are read)."""
    if not isinstance(config, SelectionConfig):
        raise TypeError(f"config must be a SelectionConfig, got {type(config).__name__}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"q must have dtype in {ACTIVATION_DTYPES}; got {_describe(q)}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape (total_q, Hq, d); got {_describe(q)}")
    if q.device != batch.device:
        raise ValueError(f"q must be on the batch's device {batch.device}; got {_describe(q)}")
    if q.shape[0] != batch.total_q:
        raise ValueError(f"q must hold cu_seqlens_q[-1]={batch.total_q} packed queries; got {_describe(q)}")
    if q.numel() and q.stride(-1) != 1:
        raise ValueError(f"q must have unit stride in d; got strides {tuple(q.stride())} ({_describe(q)})")
    _check_device("q", q)
    if not isinstance(statistics, BlockStatistics):
        raise TypeError(f"statistics must be a BlockStatistics, got {type(statistics).__name__}")
    if statistics.block_size != config.block_size:
        raise ValueError(
            f"statistics were pooled with block_size={statistics.block_size}, config.block_size="
            f"{config.block_size}; pool with the selection's block size"
        )
    pooled = statistics.pooled_k
    if pooled.device != batch.device:
        raise ValueError(f"statistics.pooled_k must be on the batch's device {batch.device}; got {_describe(pooled)}")
    total = sum(num_key_blocks(k, config.block_size) for k in batch.host.seqlens_k)
    if pooled.shape[0] != total or statistics.block_offsets.numel() != batch.num_requests + 1:
        raise ValueError(
            f"statistics do not match the batch: pooled_k {_describe(pooled)} and block_offsets "
            f"{_describe(statistics.block_offsets)}, the batch has {total} blocks of {config.block_size} tokens over "
            f"{batch.num_requests} requests"
        )
    head_dim = q.shape[2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}; q has {_describe(q)}")
    if statistics.head_dim != head_dim:
        raise ValueError(
            f"statistics.pooled_k has head dim {statistics.head_dim} ({_describe(pooled)}), q has {head_dim}"
        )
    heads = statistics.num_kv_heads
    if heads == 0 or q.shape[1] % heads:
        raise ValueError(f"Hq % Hkv != 0: q has Hq={q.shape[1]} heads ({_describe(q)}), statistics have Hkv={heads}")
    fp8 = q.dtype == torch.float8_e4m3fn
    q_descale = _check_descale("q_descale", q_descale, needed=fp8, fp8=fp8, batch=batch, num_kv_heads=heads)
    _check_descale("k_descale", k_descale, needed=False, fp8=fp8, batch=batch, num_kv_heads=heads)
    return q, statistics, config, q_descale


def capacity_bound(batch: PagedPrefillBatch, group: int, tile_size: int, block_size: int) -> int:
    """An upper bound on the causally visible (tile, block) pairs per KV head, from host values in O(B).

    Tile ``t`` of a request with ``n`` tiles sees ``(prefix + (min((t+1) T, q_len g) - 1) // g) // Bk + 1``
    blocks. The last tile is counted exactly; for the others that is at most
    ``(prefix + ((t+1) T - 1) / g) / Bk + 1``, whose sum over ``t < n - 1`` is
    ``m + (m prefix g + T m (m+1) / 2 - m) / (g Bk)`` with ``m = n - 1``, rounded up: at most one block per
    tile above the exact count, without a loop over tiles.

    Args:
        batch: the batch (its cached host view is read).
        group: GQA group size ``g``.
        tile_size: packed rows per tile ``T``.
        block_size: tokens per key block ``Bk``.

    Returns:
        The bound (0 for a batch without query tiles).
    """
    total = 0
    for q_len, prefix in zip(batch.host.q_lens, batch.host.prefix):
        n = num_query_tiles(q_len, group, tile_size)
        if n:
            m = n - 1
            numerator = m * prefix * group + tile_size * m * (m + 1) // 2 - m
            total += m + -(-numerator // (group * block_size)) + (prefix + q_len - 1) // block_size + 1
    return total


def select_blocks_triton(
    q: torch.Tensor,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics,
    *,
    config: SelectionConfig,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    workspace: IndexWorkspace | None = None,
    exact_nnz: bool = False,
) -> BlockIndex:
    """Fused max-threshold selection: the same index as :func:`fpv2.index.reference.select_blocks`.

    The pooled keys, prescaled to log2 logit units and cast to the dot dtype,
    come from the statistics when :func:`pool_blocks_triton` made them for this
    scale and query dtype (:mod:`fpv2.index.triton.prepared_keys`), else from one
    small kernel; one persistent Triton kernel scores every (request, KV head,
    tile) segment in a single pass over its candidate pooled keys, writes keep
    bits and counts and, in its last program, ``offsets`` as the prefix sum of
    the counts (see :mod:`fpv2.index.triton.scoring`); a last kernel writes the
    ascending block ids (:mod:`fpv2.index.triton.compaction`). Results equal the
    reference except for blocks whose energy ratio lies within rounding of ``alpha``.

    Memory: the returned index's tensors are fresh on every call (one allocation
    for all three; never aliased with an earlier call's result, so a kept index
    stays valid); all scratch is in ``workspace``, and a call at the same shape as
    the workspace's previous call allocates no scratch and creates no new views.

    Args:
        q: ``(total_q, Hq, d)`` packed queries (fp16, bf16, fp32 or float8_e4m3fn), unit stride in ``d``.
        batch: the paged prefill batch.
        statistics: pooled keys in real units, pooled with ``config.block_size`` for this batch
            (e.g. by :func:`pool_blocks_triton`); ``block_offsets`` values are trusted, not re-read.
        config: selection parameters.
        q_descale: ``(B, Hkv) float32`` query descales, required for FP8 queries, refused otherwise.
        k_descale: ``(B, Hkv) float32`` key descales, accepted with FP8 queries and checked but not
            applied: the statistics are already dequantised (as in the reference).
        workspace: scratch reused across calls, one per CUDA stream (calls on one stream are ordered);
            None allocates a fresh one for this call.
        exact_nnz: size ``blocks`` exactly, which reads ``offsets[-1]`` on the host (one 4-byte sync).
            With False (the default) there is no host sync: ``blocks`` has room for every causally
            visible (tile, block) pair (:func:`capacity_bound`), its first ``offsets[-1]`` entries are
            the index and the rest are left uninitialised (spare capacity, which the block index
            contract allows and kernels never read).

    Returns:
        The :class:`~fpv2.kernel.BlockIndex` (built with ``check_values=False``), segment order
        request, KV head, tile; ``tile_size`` and ``block_size`` from ``config``.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: shapes, devices or strides are inconsistent; the message names the argument.
    """
    batch = _check_batch(batch)
    q, statistics, config, q_descale = _check_selection(q, batch, statistics, config, q_descale, k_descale)
    if workspace is None:
        workspace = IndexWorkspace()
    elif not isinstance(workspace, IndexWorkspace):
        raise TypeError(f"workspace must be an IndexWorkspace or None, got {type(workspace).__name__}")
    device = batch.device
    heads = statistics.num_kv_heads
    group = q.shape[1] // heads
    tile_size, block_size = config.tile_size, config.block_size
    host = batch.host

    tiles = [num_query_tiles(n, group, tile_size) for n in host.q_lens]
    num_segments = heads * sum(tiles)
    max_blocks = max((num_key_blocks(k, block_size) for k in host.seqlens_k), default=0)
    num_requests = batch.num_requests
    parts = [((num_requests + 1,), torch.int32), ((num_segments + 1,), torch.int32)]
    if not exact_nnz:  # blocks sized by the host bound: one allocation for the whole index
        parts.append(((heads * capacity_bound(batch, group, tile_size, block_size),), torch.int32))
    outs = fresh_outputs(device, parts)
    tile_offsets, offsets = outs[0], outs[1]
    if num_segments == 0:  # no query tiles: nothing to launch (the kernel would write these)
        tile_offsets.zero_()
        offsets.zero_()
        return BlockIndex(
            offsets, offsets.new_empty(0), tile_offsets, heads, group, tile_size, block_size, check_values=False
        )
    interpret = interpreter_enabled()
    kind = dot_kind(q.dtype, interpret)
    scale_log2 = logit_scale_log2(config.softmax_scale, q.shape[2])
    keys = matching_keys(statistics, scale_log2, kind)
    if keys is None:
        keys = launch_prepare_keys(statistics.pooled_k, scale_log2, kind)
    if use_hopper_scoring(q, config, statistics.head_dim, max_blocks, q_descale is not None):
        # One energies row: the Hopper kernel keeps its energies in shared memory.
        views = workspace.reserve(num_programs=1, max_blocks=max_blocks, num_segments=num_segments, device=device)
        _launch_hopper_scoring(q, keys, batch, statistics, tile_offsets, offsets, views, sum(tiles), max_blocks, config)
    else:
        views = _launch_triton_scoring(
            q, keys, q_descale, batch, statistics, tile_offsets, offsets, workspace, tiles, max_blocks, group,
            config, kind, interpret,
        )  # fmt: skip
    if exact_nnz:
        blocks = torch.empty(int(offsets[-1]), dtype=torch.int32, device=device)  # the one documented sync
    else:
        blocks = outs[2]
    launch_compact(views.keep_bits, offsets, blocks)
    return BlockIndex(offsets, blocks, tile_offsets, heads, group, tile_size, block_size, check_values=False)


def _launch_hopper_scoring(
    q: torch.Tensor,
    keys: torch.Tensor,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics,
    tile_offsets: torch.Tensor,
    offsets: torch.Tensor,
    views: WorkspaceViews,
    num_tiles: int,
    max_blocks: int,
    config: SelectionConfig,
) -> None:
    """The kernel library's wgmma scoring of one call (:mod:`.hopper_scoring`): keep bits, counts and offsets."""
    from fpv2.kernel._native.score import ScoreRule, score_blocks

    rule = ScoreRule(
        alpha=float(config.alpha),
        block_size=config.block_size,
        sink_blocks=-(-config.sink_tokens // config.block_size),
        window_tokens=config.window_tokens,
        dense_tail_tiles=config.dense_tail_tiles,
        min_sparse_kv_len=config.min_sparse_kv_len,
    )
    score_blocks(
        q, keys, cu_seqlens_q=batch.cu_seqlens_q, seqlens_k=batch.seqlens_k, block_offsets=statistics.block_offsets,
        tile_offsets=tile_offsets, offsets=offsets, counts=views.counts, keep_bits=views.keep_bits,
        num_tiles=num_tiles, max_blocks=max_blocks, rule=rule, tile_size=config.tile_size,
    )  # fmt: skip


def _launch_triton_scoring(
    q: torch.Tensor,
    keys: torch.Tensor,
    q_descale: torch.Tensor | None,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics,
    tile_offsets: torch.Tensor,
    offsets: torch.Tensor,
    workspace: IndexWorkspace,
    tiles: list[int],
    max_blocks: int,
    group: int,
    config: SelectionConfig,
    kind: int,
    interpret: bool,
) -> WorkspaceViews:
    """The fused Triton scoring/selection pass of one call (:mod:`.scoring`); returns the workspace views it wrote."""
    heads, tile_size = statistics.num_kv_heads, config.tile_size
    rows = score_rows(tile_size, config.probe_stride)
    # Read once: the work split, the grid, the workspace and the launch must agree.
    knobs = tuning.SCORE.for_call(max_blocks, rows, tile_size, head_dim=statistics.head_dim)
    total_units = num_units(tiles, knobs.tiles_per_program)
    num_programs = workspace.num_programs(heads * total_units, batch.device, rows, statistics.head_dim)
    views = workspace.reserve(
        num_programs=num_programs,
        max_blocks=max_blocks,
        num_segments=heads * sum(tiles),
        device=batch.device,
        tiles_per_program=knobs.tiles_per_program,
    )
    try:
        launch_score_select(
            q,
            keys,
            q_descale=q_descale,
            cu_seqlens_q=batch.cu_seqlens_q,
            seqlens_k=batch.seqlens_k,
            block_offsets=statistics.block_offsets,
            tile_offsets=tile_offsets,
            offsets=offsets,
            views=views,
            total_units=total_units,
            num_programs=num_programs,
            group=group,
            alpha=config.alpha,
            tile_size=config.tile_size,
            block_size=config.block_size,
            probe_stride=config.probe_stride,
            sink_tokens=config.sink_tokens,
            window_tokens=config.window_tokens,
            dense_tail_tiles=config.dense_tail_tiles,
            min_sparse_kv_len=config.min_sparse_kv_len,
            dot_kind=kind,
            interpret=interpret,
            knobs=knobs,
        )
    except BaseException:
        workspace.reset_counter()  # a kernel that stopped part way may have left the counter counting
        raise
    return views
