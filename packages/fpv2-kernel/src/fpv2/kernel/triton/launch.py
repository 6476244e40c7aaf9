"""Python entry point of the Triton kernel: input checks, per-program metadata, launch.

The grid has one program per segment (request, KV head, query tile) of the
block index, in the index's segment order. Each program finds its request in a
small ``(S,) int32`` table built on the device with ``torch.searchsorted`` over
the cumulative tile counts (no host sync for it); its KV head, tile, prefix and
lengths it derives itself from the batch metadata. The grid size ``S`` is a
host value: it comes from the index's shape, or in dense mode from the batch's
cached host view. Programs run in segment order (last to first, ``reverse_grid``),
or heaviest first (:mod:`.work_order`: by default chunks after a cached prefix;
``FPV2_TRITON_WORK_ORDER`` overrides).

Host syncs: the input validation reads the batch's small index arrays once
(cached on the batch); ``BlockIndex.check_compatible`` reads the index once per
(index, batch) unless its producer vouched for the batch. A correction plan costs
no host sync: its statistics' ``block_offsets`` are compared with the batch on the
device (``torch._assert_async``: a mismatch fails the next synchronising call
with a device-side assertion), once per (statistics, batch), and plans without
todo words get them from a small device kernel (:mod:`.todo_words`).
"""

from __future__ import annotations

import math
import weakref

import torch
from triton.runtime.interpreter import InterpretedFunction

from ..contracts import (
    BLOCK_SIZE,
    CORRECTION_CHUNK,
    TILE_SIZE,
    BlockIndex,
    BlockStatistics,
    CorrectionPlan,
    PagedPrefillBatch,
    PrefillShapes,
    num_key_blocks,
    num_query_tiles,
    validate_prefill_inputs,
)
from ..contracts._checks import check_last_dim_contiguous, check_shape, check_tensor, describe
from .interpreter_compat import install_interpreter_index_fix
from .sparse_attention import (
    DOT_FP16,
    DOT_FP32,
    DOT_INTERP_BF16,
    DOT_INTERP_FP8,
    DOT_NATIVE,
    sparse_prefill_kernel,
)
from .todo_words import segment_requests, todo_words
from .tuning import LaunchConfig, launch_config
from .work_order import segment_work_order, use_work_order

#: Packed query rows per program: the kernel's query tile, which must equal the index tile size.
BLOCK_M = TILE_SIZE
#: ``log2(e)``: logits are scaled into log2 units once, so the kernel uses ``exp2``.
LOG2E = 1.4426950408889634
#: FP8 probabilities are ``2^(s - m + P_SHIFT_FP8)``: [0, 1] mapped onto [0, 256] before the e4m3 cast.
P_SHIFT_FP8 = 8.0
#: Largest block size of a correction plan for fp16 inputs: pooled probabilities reach the block length.
MAX_FP16_CORRECTION_BLOCK = 32768


def is_interpreted() -> bool:
    """Whether the kernel was built for the Triton interpreter (``TRITON_INTERPRET=1`` at import).

    Returns:
        True when the kernel runs on the CPU through the interpreter.
    """
    return isinstance(sparse_prefill_kernel, InterpretedFunction)


def sparse_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    index: BlockIndex | None = None,
    *,
    plan: CorrectionPlan | None = None,
    softmax_scale: float | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    launch: LaunchConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse (or dense) causal prefill attention over a paged KV cache, in Triton.

    Same semantics as :func:`fpv2.kernel.reference.sparse.sparse_attention`: every
    (request, KV head, tile) segment's PackGQA rows attend exactly to the tokens of
    its kept blocks (bottom-right causal mask inside the diagonal band), and with a
    ``plan`` every eligible pruned block adds its pooled key/value with logit
    ``q . kbar * scale + log |B_J|`` (plus the second-order mass shift when the plan
    carries a ``key_spread``). Works for every page size (1 included).

    FP8 (``float8_e4m3fn``) inputs: the logit scale absorbs ``q_descale * k_descale``
    of the tile's (request, KV head), probabilities are ``2^(s - m + 8)`` rounded to
    e4m3 for the PV product (fp8 tensor cores on sm89+; on older GPUs the e4m3 values
    are widened to fp16; under the interpreter the products run in fp32 on P rounded to
    the e4m3 grid in fp32 arithmetic, because the interpreter's own e4m3 cast misrounds),
    and the output is multiplied by ``v_descale`` and written in bf16. Under the
    interpreter, bf16 outputs are truncated rather than rounded (its cast), a bias of
    at most one bf16 ulp.

    Args:
        q: ``(total_q, Hq, d)`` packed queries (fp16, bf16, e4m3, or fp32 for tests).
        k_cache, v_cache: ``(num_pages, page_size, Hkv, d)`` paged cache, same dtype as ``q``.
        batch: the batch metadata (query offsets, KV lengths, page table).
        index: kept blocks per segment; ``None`` is dense mode (every causally visible
            block, no CSR needed).
        plan: mean correction for pruned blocks (needs ``index``); todo words from
            ``plan.todo_masks`` when present, else built from the index on the device.
        softmax_scale: logit scale, ``1 / sqrt(d)`` by default.
        q_descale, k_descale, v_descale: ``(B, Hkv) float32`` descales, required for
            (and only for) FP8 inputs.
        out: optional ``(total_q, Hq, d)`` output buffer (input dtype; bf16 for FP8).
        return_lse: also return the natural-log log-sum-exp of each row.
        launch: launch parameters to use instead of the tuning table's (tuning scripts);
            ``block_n`` must divide the index's block size.

    Returns:
        ``out`` (total_q, Hq, d); with ``return_lse`` also ``lse (total_q, Hq) float32``.
        A row that sees no key at all gets 0 and lse ``-inf``.

    Raises:
        TypeError: wrong argument types or dtypes.
        ValueError: inconsistent shapes or devices, an index or plan built for another
            batch, group, tile size or block size, a plan without an index, a plan with
            blocks of more than 32768 tokens for fp16 inputs, or CPU tensors without the
            Triton interpreter.
    """
    shapes = validate_prefill_inputs(
        q, k_cache, v_cache, batch, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
    )
    interpreted = is_interpreted()
    if q.device.type != "cuda" and not interpreted:
        raise ValueError(
            f"the Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run on "
            f"the CPU; q has {describe(q)}"
        )
    if interpreted:
        install_interpreter_index_fix()
    group = shapes.group
    if index is not None:
        _check_index(index, batch, shapes, q.device)
    block_size = index.block_size if index is not None else BLOCK_SIZE
    if plan is not None:
        if index is None:
            raise ValueError(
                "plan was given without an index: dense mode keeps every block, so there is nothing to correct; "
                "pass the block index the plan was built for"
            )
        _check_plan(plan, index, batch, shapes, q.device)
    scale = _resolve_scale(softmax_scale, shapes.head_dim)
    if launch is None:
        mode = "dense" if index is None else "sparse" if plan is None else "correction"
        config = launch_config(shapes.head_dim, block_size, mode, fp8=shapes.is_fp8)
    else:
        config = _check_launch(launch, block_size)

    out_dtype = torch.bfloat16 if shapes.is_fp8 else q.dtype
    expected_out = (q.shape[0], shapes.num_q_heads, shapes.head_dim)
    if out is None:
        out = torch.empty(expected_out, dtype=out_dtype, device=q.device)
    else:
        check_tensor("out", out, dtypes=(out_dtype,), ndim=3, device=q.device)
        check_shape("out", out, expected_out)
        check_last_dim_contiguous("out", out)
    lse = torch.empty(q.shape[0], shapes.num_q_heads, dtype=torch.float32, device=q.device) if return_lse else None

    # Per-program metadata: request of each segment, from the cumulative tile counts (device only).
    if index is not None:
        tile_offsets = index.tile_offsets
        num_segments = index.num_segments
    else:
        tiles = (batch.q_lens * group + BLOCK_M - 1) // BLOCK_M
        tile_offsets = torch.zeros(batch.num_requests + 1, dtype=torch.int32, device=q.device)
        tile_offsets[1:] = tiles.cumsum(0)
        num_segments = shapes.num_kv_heads * sum(num_query_tiles(n, group, BLOCK_M) for n in batch.host.q_lens)
    if num_segments == 0:
        return (out, lse) if return_lse else out
    seg_request = segment_requests(tile_offsets, shapes.num_kv_heads, num_segments)
    ordered = index is not None and use_work_order(num_segments, q.device)

    dummy_i32 = torch.zeros(1, dtype=torch.int32, device=q.device)
    dummy_f32 = torch.zeros(1, dtype=torch.float32, device=q.device)
    corr_kind = _correction_kind(shapes.dtype, interpreted)
    if plan is not None:
        pooled = _correction_operands(plan.statistics, corr_kind)
        if plan.todo_masks is not None:
            todo_offsets, todo_masks = plan.todo_offsets, plan.todo_masks
        else:
            todo_offsets, todo_masks = todo_words(index, batch, seg_request)
        if todo_masks.numel() == 0:
            todo_masks = torch.zeros(1, dtype=torch.int64, device=q.device)
        spread = plan.key_spread
    else:
        spread = None
        pooled = (dummy_f32,) * 2
        todo_offsets, todo_masks = dummy_i32, torch.zeros(1, dtype=torch.int64, device=q.device)

    if shapes.dtype == torch.float32:
        dot_kind = DOT_FP32
    elif interpreted:
        # The interpreter's bf16 dot and its bf16/e4m3 casts are wrong: see sparse_attention.DOT_INTERP_*.
        dot_kind = {torch.float16: DOT_NATIVE, torch.bfloat16: DOT_INTERP_BF16}.get(shapes.dtype, DOT_INTERP_FP8)
    elif shapes.is_fp8 and torch.cuda.get_device_capability(q.device) < (8, 9):
        dot_kind = DOT_FP16
    else:
        dot_kind = DOT_NATIVE

    sparse_prefill_kernel[(num_segments,)](
        q,
        k_cache,
        v_cache,
        out,
        lse if lse is not None else dummy_f32,
        batch.cu_seqlens_q,
        batch.seqlens_k,
        batch.page_table,
        seg_request,
        segment_work_order(index.offsets, num_segments) if ordered else dummy_i32,
        tile_offsets,
        index.offsets if index is not None else dummy_i32,
        index.blocks if index is not None and index.blocks.numel() > 0 else dummy_i32,
        q_descale.contiguous() if q_descale is not None else dummy_f32,
        k_descale.contiguous() if k_descale is not None else dummy_f32,
        v_descale.contiguous() if v_descale is not None else dummy_f32,
        *pooled,
        plan.statistics.block_lengths if plan is not None else dummy_i32,
        plan.statistics.block_offsets if plan is not None else dummy_i32,
        todo_offsets,
        todo_masks,
        spread.variance if spread is not None else dummy_f32,
        spread.radius if spread is not None else dummy_f32,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        batch.page_table.stride(0),
        pooled[0].stride(0) if plan is not None else 0,
        pooled[0].stride(1) if plan is not None else 0,
        spread.variance.stride(0) if spread is not None else 0,
        NUM_KV_HEADS=shapes.num_kv_heads,
        GROUP=group,
        HEAD_DIM=shapes.head_dim,
        BLOCK_M=BLOCK_M,
        BLOCK_N=config.block_n,
        BLOCK_SIZE=block_size,
        PAGE_SIZE=batch.page_size,
        BAND=_band(block_size),
        CHUNK=CORRECTION_CHUNK,
        CORR_N=config.correction_step,
        DENSE=index is None,
        CORRECTION=plan is not None,
        SECOND_ORDER=spread is not None,
        FP8=shapes.is_fp8,
        P_SHIFT=P_SHIFT_FP8 if shapes.is_fp8 else 0.0,
        DOT_KIND=dot_kind,
        CORR_KIND=corr_kind,
        WRITE_LSE=return_lse,
        PIPE_STAGES=config.num_stages,
        CORR_STAGES=config.correction_stages,
        REVERSE=config.reverse_grid,
        ORDERED=ordered,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return (out, lse) if return_lse else out


def _correction_kind(dtype: torch.dtype, interpreted: bool) -> int:
    """Operands of the correction step: 0 fp32 (IEEE products), 1 fp16, 2 bf16 (see ``_correct_chunk``).

    fp32 inputs keep fp32; fp16 inputs use fp16 (also under the interpreter, whose fp16
    dot is exact); bf16 and e4m3 use bf16 on a GPU (e4m3 queries widen to bf16 exactly)
    and fp32 under the interpreter (its bf16 dot is broken).
    """
    if dtype == torch.float16:
        return 1
    if dtype == torch.float32 or interpreted:
        return 0
    return 2


def _correction_operands(stats: BlockStatistics, corr_kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pooled_k, pooled_v)`` in the element type of the correction step, one set of strides.

    Kind 0 reads the fp32 statistics as they are; kinds 1 and 2 round them once to fp16
    or bf16 (two small ``(total_blocks, Hkv, d)`` arrays per call), so the correction
    runs on the tensor cores like the main loop. Pooled keys are means of the 16-bit
    keys themselves and pooled values enter only the pruned blocks' share of each row,
    so the rounding is of the order of the inputs' own: on an H200 at 128K (planted
    workload, alpha 0.1) the relative error vs dense stays 0.0444, as with the former
    two-term (head + remainder) operands.
    """
    pooled_k = stats.pooled_k.contiguous()
    pooled_v = stats.pooled_v.contiguous()
    if corr_kind == 0:
        return pooled_k, pooled_v
    half = torch.float16 if corr_kind == 1 else torch.bfloat16
    return pooled_k.to(half), pooled_v.to(half)


def _band(block_size: int) -> int:
    """Most kept blocks a tile can have in its diagonal band, rounded up to a power of two.

    The tile's rows span at most ``BLOCK_M`` consecutive positions, so the blocks not
    wholly visible to its first row number at most ``ceil(BLOCK_M / block_size) + 1``.
    """
    band = -(-BLOCK_M // block_size) + 1
    return 1 << (band - 1).bit_length()


def _resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """``1 / sqrt(d)`` unless a finite positive scale is given (TypeError/ValueError otherwise)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None; got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and positive; got {softmax_scale}")
    return float(softmax_scale)


def _check_index(index: BlockIndex, batch: PagedPrefillBatch, shapes: PrefillShapes, device: torch.device) -> None:
    """The index must be a BlockIndex for this batch, group, head count and the kernel's tile size."""
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index must be a BlockIndex or None; got {type(index).__name__}")
    if index.offsets.device != device:
        raise ValueError(f"index must be on {device} like q; its offsets have {describe(index.offsets)}")
    if index.num_kv_heads != shapes.num_kv_heads:
        raise ValueError(f"block index has num_kv_heads={index.num_kv_heads}, k_cache has Hkv={shapes.num_kv_heads}")
    # The kernel's query tile is BLOCK_M packed rows: an index built for other tiles is refused.
    index.check_compatible(batch, shapes.group, tile_size=BLOCK_M)


def _check_launch(launch: LaunchConfig, block_size: int) -> LaunchConfig:
    """An explicit launch configuration must be a LaunchConfig whose ``block_n`` divides the block size."""
    if not isinstance(launch, LaunchConfig):
        raise TypeError(f"launch must be a LaunchConfig or None; got {type(launch).__name__}")
    if block_size % launch.block_n:
        raise ValueError(f"launch.block_n={launch.block_n} does not divide the index block_size={block_size}")
    return launch


#: Statistics already checked against a batch (on the device): later calls with the same
#: statistics and batch, whatever the plan object wrapping them, enqueue no check.
_CHECKED_STATISTICS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_plan(
    plan: CorrectionPlan, index: BlockIndex, batch: PagedPrefillBatch, shapes: PrefillShapes, device: torch.device
) -> None:
    """The plan's statistics and todo words must fit the index, the batch and the cache (no host sync).

    Shapes and the total block count are checked on the host (the batch's host view is
    cached); the per-request ``block_offsets`` values are compared with the batch on
    the device, once per (statistics, batch), through ``torch._assert_async``: on a GPU a
    mismatch surfaces as a device-side assertion at the next synchronising call (on the
    CPU it raises at once).
    """
    if not isinstance(plan, CorrectionPlan):
        raise TypeError(f"plan must be a CorrectionPlan or None; got {type(plan).__name__}")
    stats = plan.statistics
    if stats.pooled_k.device != device:
        raise ValueError(f"plan statistics must be on {device} like q; pooled_k has {describe(stats.pooled_k)}")
    if stats.block_size != index.block_size:
        raise ValueError(f"plan statistics use block_size={stats.block_size}, the index block_size={index.block_size}")
    if shapes.dtype == torch.float16 and stats.block_size > MAX_FP16_CORRECTION_BLOCK:
        # The correction weighs each pooled column's probabilities by its block length, and fp16 inputs take
        # those probabilities into the PV product as fp16: lengths past 32768 could overflow it.
        raise ValueError(
            f"fp16 inputs with a correction plan need block_size <= {MAX_FP16_CORRECTION_BLOCK}; got "
            f"{stats.block_size} (use bf16 inputs or smaller blocks)"
        )
    expected = (shapes.num_kv_heads, shapes.head_dim)
    if tuple(stats.pooled_k.shape[1:]) != expected:
        raise ValueError(
            f"plan statistics pooled_k must have shape (*, {expected[0]}, {expected[1]}); "
            f"got {describe(stats.pooled_k)}"
        )
    if stats.block_offsets.numel() != batch.num_requests + 1:
        raise ValueError(
            f"plan statistics block_offsets must have B+1 = {batch.num_requests + 1} entries; got "
            f"{describe(stats.block_offsets)}"
        )
    needed = [num_key_blocks(k, index.block_size) for k in batch.host.seqlens_k]
    if stats.pooled_k.shape[0] != sum(needed):
        raise ValueError(
            f"plan statistics hold {stats.pooled_k.shape[0]} pooled blocks; the batch needs {sum(needed)} "
            f"({needed[:8]} per request with block_size {index.block_size})"
        )
    if plan.todo_offsets is not None:
        check_shape("todo_offsets", plan.todo_offsets, (index.num_segments + 1,))
        if not (plan.todo_offsets.is_contiguous() and plan.todo_masks.is_contiguous()):
            raise ValueError("todo_offsets and todo_masks must be contiguous")
    checked = _CHECKED_STATISTICS.setdefault(stats, weakref.WeakKeyDictionary())
    if batch in checked:
        return
    counts = (batch.seqlens_k.long() + index.block_size - 1) // index.block_size
    offsets = torch.zeros(batch.num_requests + 1, dtype=torch.long, device=device)
    offsets[1:] = counts.cumsum(0)
    torch._assert_async(
        (stats.block_offsets.long() == offsets).all(),
        "plan statistics block_offsets do not match the batch's blocks per request",
    )
    checked[batch] = True
