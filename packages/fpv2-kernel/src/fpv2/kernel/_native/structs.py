"""ctypes mirrors of the C ABI structs, and their builders from the Python contracts.

Each class below has exactly the fields, order and types of its C struct in
``include/fpv2/fpv2.h`` (the tests compare every offset against a C compiler's).
The builders fill them from torch tensors and the contract dataclasses without
reading tensor data: only pointers, shapes, strides and dtypes are recorded, so
CPU and CUDA tensors work alike. A built struct keeps every tensor and nested
struct it points to alive for as long as the struct itself lives.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import ClassVar

import torch

from ..contracts import BlockIndex, BlockStatistics, CorrectionPlan, PagedPrefillBatch
from ..reference.pooled_e4m3 import PooledE4M3
from .codes import MAX_NDIM, PREFILL_CAUSAL, DType

#: torch dtype -> ``fpv2_dtype_t`` code: the one table of the binding.
TORCH_TO_DTYPE: dict[torch.dtype, DType] = {
    torch.float16: DType.F16,
    torch.bfloat16: DType.BF16,
    torch.float32: DType.F32,
    torch.float8_e4m3fn: DType.E4M3,
    torch.int32: DType.I32,
    torch.int64: DType.I64,
}

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class TensorDesc(ctypes.Structure):
    """``fpv2_tensor_t``: pointer, dtype code, rank, shape and strides (in elements).

    An all-zero instance is an absent optional tensor.
    """

    c_name: ClassVar[str] = "fpv2_tensor_t"
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * MAX_NDIM),
        ("strides", ctypes.c_int64 * MAX_NDIM),
    ]


class PagedBatchStruct(ctypes.Structure):
    """``fpv2_paged_batch_t`` (mirrors :class:`~fpv2.kernel.contracts.PagedPrefillBatch`)."""

    c_name: ClassVar[str] = "fpv2_paged_batch_t"
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("num_requests", ctypes.c_int32),
        ("cu_seqlens_q", TensorDesc),
        ("seqlens_k", TensorDesc),
        ("page_table", TensorDesc),
        ("page_size", ctypes.c_int32),
        ("num_pages", ctypes.c_int32),
        ("total_q", ctypes.c_int64),
        ("max_seqlen_q", ctypes.c_int32),
        ("max_seqlen_k", ctypes.c_int32),
    ]


class BlockIndexStruct(ctypes.Structure):
    """``fpv2_block_index_t`` (mirrors :class:`~fpv2.kernel.contracts.BlockIndex`)."""

    c_name: ClassVar[str] = "fpv2_block_index_t"
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("num_kv_heads", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("tile_size", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("offsets", TensorDesc),
        ("blocks", TensorDesc),
        ("tile_offsets", TensorDesc),
        ("num_segments", ctypes.c_int64),
    ]


class CorrectionPlanStruct(ctypes.Structure):
    """``fpv2_correction_plan_t`` (mirrors :class:`~fpv2.kernel.contracts.CorrectionPlan`)."""

    c_name: ClassVar[str] = "fpv2_correction_plan_t"
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("chunk_size", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("pooled_k", TensorDesc),
        ("pooled_v", TensorDesc),
        ("block_lengths", TensorDesc),
        ("block_offsets", TensorDesc),
        ("todo_offsets", TensorDesc),
        ("todo_masks", TensorDesc),
        # ABI 1.2: the optional E4M3 copies of the pooled statistics (all four or none).
        ("pooled_k_e4m3", TensorDesc),
        ("pooled_vt_e4m3", TensorDesc),
        ("e4m3_offsets", TensorDesc),
        ("e4m3_scales", TensorDesc),
        # ABI 1.5: the optional key spread of the second-order mass shift (both or neither).
        ("key_variance", TensorDesc),
        ("key_radius", TensorDesc),
    ]


#: ``FPV2_CORRECTION_PLAN_SIZE_V1_1``: the plan's size before the E4M3 copies, which libraries still accept.
CORRECTION_PLAN_SIZE_V1_1: int = CorrectionPlanStruct.pooled_k_e4m3.offset
#: ``FPV2_CORRECTION_PLAN_SIZE_V1_2``: the plan's size before the key spread (ABI 1.2 to 1.4), still accepted.
CORRECTION_PLAN_SIZE_V1_2: int = CorrectionPlanStruct.key_variance.offset


class PrefillArgsStruct(ctypes.Structure):
    """``fpv2_prefill_args_t``: everything one prefill call needs."""

    c_name: ClassVar[str] = "fpv2_prefill_args_t"
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("q", TensorDesc),
        ("k_cache", TensorDesc),
        ("v_cache", TensorDesc),
        ("out", TensorDesc),
        ("lse", TensorDesc),
        ("batch", ctypes.POINTER(PagedBatchStruct)),
        ("index", ctypes.POINTER(BlockIndexStruct)),
        ("correction", ctypes.POINTER(CorrectionPlanStruct)),
        ("q_descale", TensorDesc),
        ("k_descale", TensorDesc),
        ("v_descale", TensorDesc),
        ("softmax_scale", ctypes.c_float),
        ("device", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_uint64),
    ]


class ScoreArgsStruct(ctypes.Structure):
    """``fpv2_score_args_t`` (ABI 1.4): one call of the index stage's block scoring (:mod:`.score`)."""

    c_name: ClassVar[str] = "fpv2_score_args_t"
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("num_requests", ctypes.c_int32),
        ("q", TensorDesc),
        ("keys", TensorDesc),
        ("cu_seqlens_q", TensorDesc),
        ("seqlens_k", TensorDesc),
        ("block_offsets", TensorDesc),
        ("tile_offsets", TensorDesc),
        ("offsets", TensorDesc),
        ("counts", TensorDesc),
        ("keep_bits", TensorDesc),
        ("group", ctypes.c_int32),
        ("tile_size", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("max_blocks", ctypes.c_int32),
        ("num_tiles", ctypes.c_int64),
        ("alpha", ctypes.c_float),
        ("sink_blocks", ctypes.c_int32),
        ("window_tokens", ctypes.c_int32),
        ("dense_tail_tiles", ctypes.c_int32),
        ("min_sparse_kv_len", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
    ]


#: Every size-prefixed struct of the ABI.
SIZED_STRUCTS: tuple[type[ctypes.Structure], ...] = (
    PagedBatchStruct,
    BlockIndexStruct,
    CorrectionPlanStruct,
    PrefillArgsStruct,
    ScoreArgsStruct,
)


def _int32(name: str, value: int) -> int:
    """Refuse values a C ``int32_t`` field would silently wrap."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise ValueError(f"{name}={value} does not fit the ABI's int32 field")
    return value


def _keep_alive(struct: ctypes.Structure, objects: Iterable[object]) -> None:
    """Attach the Python objects a struct points into, so they outlive the raw pointers."""
    struct._fpv2_keepalive = tuple(obj for obj in objects if obj is not None)  # type: ignore[attr-defined]


def tensor_desc(t: torch.Tensor | None, name: str = "tensor") -> TensorDesc:
    """Describe a tensor as an ``fpv2_tensor_t`` (``None`` gives the absent tensor).

    The descriptor holds a raw pointer and does NOT keep ``t`` alive; the struct
    builders below do that for the tensors they are given.

    Args:
        t: a strided tensor of rank <= 4 on any device, or None.
        name: argument name used in error messages.

    Returns:
        The descriptor.

    Raises:
        TypeError: ``t`` is not a tensor, not strided, or has a dtype the ABI lacks.
        ValueError: ``t`` has more than 4 dimensions.
    """
    if t is None:
        return TensorDesc()
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a strided (dense) tensor; got layout {t.layout}, shape {tuple(t.shape)}")
    code = TORCH_TO_DTYPE.get(t.dtype)
    if code is None:
        allowed = ", ".join(str(d) for d in TORCH_TO_DTYPE)
        raise TypeError(f"{name} has dtype {t.dtype}, which the C ABI cannot describe (one of {allowed})")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"{name} has rank {t.dim()} > {MAX_NDIM}; got shape {tuple(t.shape)}, dtype {t.dtype}")
    # Slice assignments and one constructor call: this runs ~24 times per prefill call, on the host path
    # that the GPU waits for at short lengths (benchmarks/NOTES.md, 2026-12-01 fifth session).
    ndim = t.dim()
    desc = TensorDesc(t.data_ptr() or None, int(code), ndim)
    desc.shape[:ndim] = t.shape
    desc.strides[:ndim] = t.stride()
    return desc


def paged_batch_struct(batch: PagedPrefillBatch) -> PagedBatchStruct:
    """Build ``fpv2_paged_batch_t`` from a batch (reads its small host lengths once, cached).

    The fields are built once per batch (the batch is immutable) and kept on it as bytes; each
    call returns a new struct made from them that keeps ``batch`` alive (:func:`_cached_batch_fields`).

    Args:
        batch: the batch metadata.

    Returns:
        The struct, keeping ``batch`` alive.

    Raises:
        TypeError: ``batch`` is not a :class:`PagedPrefillBatch`.
    """
    if not isinstance(batch, PagedPrefillBatch):
        raise TypeError(f"batch must be a PagedPrefillBatch, got {type(batch).__name__}")
    struct = PagedBatchStruct.from_buffer_copy(_cached_batch_fields(batch))
    _keep_alive(struct, [batch])
    return struct


#: Key of the cached fields in a batch's instance dict (frozen dataclasses allow such entries, as ``host``).
_BATCH_FIELDS_KEY = "_fpv2_abi_batch_fields"


def _cached_batch_fields(batch: PagedPrefillBatch) -> bytes:
    """The bytes of the batch's struct, built on first use and cached on the batch (~30 us per build on the host path).

    Plain bytes: the cache holds no reference to anything, so it makes no reference cycle
    with the batch (which is freed as soon as its last user lets go, not at a later garbage
    collection) and copies and pickles with it like ``host``. Its raw pointers are only ever
    used through a struct that keeps the batch alive (:func:`paged_batch_struct`), so they never
    outlive the tensors they point into. The batch's tensors are never replaced (frozen); the
    bytes are rebuilt when the tensors' data pointers differ from theirs all the same (a copied
    batch, ``Tensor.set_``).
    """
    pointers = (batch.cu_seqlens_q.data_ptr(), batch.seqlens_k.data_ptr(), batch.page_table.data_ptr())
    cached = batch.__dict__.get(_BATCH_FIELDS_KEY)
    if cached is not None and cached[0] == pointers:
        return cached[1]
    fields = PagedBatchStruct(
        struct_size=ctypes.sizeof(PagedBatchStruct),
        num_requests=_int32("batch.num_requests", batch.num_requests),
        cu_seqlens_q=tensor_desc(batch.cu_seqlens_q, "batch.cu_seqlens_q"),
        seqlens_k=tensor_desc(batch.seqlens_k, "batch.seqlens_k"),
        page_table=tensor_desc(batch.page_table, "batch.page_table"),
        page_size=_int32("batch.page_size", batch.page_size),
        num_pages=_int32("batch.num_pages", batch.num_pages),
        total_q=batch.total_q,
        max_seqlen_q=_int32("batch.max_seqlen_q", batch.max_seqlen_q),
        max_seqlen_k=_int32("batch.max_seqlen_k", batch.max_seqlen_k),
    )
    raw = bytes(fields)
    batch.__dict__[_BATCH_FIELDS_KEY] = (pointers, raw)
    return raw


def block_index_struct(index: BlockIndex) -> BlockIndexStruct:
    """Build ``fpv2_block_index_t`` from a block index.

    Args:
        index: the CSR block index.

    Returns:
        The struct, keeping ``index`` alive.

    Raises:
        TypeError: ``index`` is not a :class:`BlockIndex`.
    """
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index must be a BlockIndex, got {type(index).__name__}")
    struct = BlockIndexStruct(
        struct_size=ctypes.sizeof(BlockIndexStruct),
        num_kv_heads=_int32("index.num_kv_heads", index.num_kv_heads),
        group=_int32("index.group", index.group),
        tile_size=_int32("index.tile_size", index.tile_size),
        block_size=_int32("index.block_size", index.block_size),
        offsets=tensor_desc(index.offsets, "index.offsets"),
        blocks=tensor_desc(index.blocks, "index.blocks"),
        tile_offsets=tensor_desc(index.tile_offsets, "index.tile_offsets"),
        num_segments=index.num_segments,
    )
    _keep_alive(struct, [index])
    return struct


def correction_plan_struct(
    plan: CorrectionPlan, *, pooled_dtype: torch.dtype | None = None, pooled_e4m3: PooledE4M3 | None = None
) -> CorrectionPlanStruct:
    """Build ``fpv2_correction_plan_t`` from a correction plan and its block statistics.

    Args:
        plan: the plan (its ``statistics`` supply the pooled tensors and block size).
        pooled_dtype: hand the pooled K/V over in this dtype (``torch.bfloat16`` for the
            Hopper kernel, which loads them with TMA); None passes them as they are
            (float32). The statistics' own copies are used when they have them
            (:func:`_pooled_as`), else a converted copy is made on the tensors' stream;
            either is kept alive. Ignored when ``pooled_e4m3`` is given.
        pooled_e4m3: E4M3 copies of the plan's pooled K/V (from
            :func:`fpv2.kernel.triton.pooled_e4m3.quantize_pooled_e4m3`) for the Hopper
            kernel's FP8 correction; the plan's float32 pooled K/V are then passed as they
            are (that kernel does not read them). None leaves the four fields absent.

    Returns:
        The struct, keeping ``plan`` (and any converted copy or E4M3 copies) alive.

    Raises:
        TypeError: ``plan`` is not a :class:`CorrectionPlan`, ``pooled_e4m3`` not a
            :class:`~fpv2.kernel.reference.pooled_e4m3.PooledE4M3`, or a tensor the ABI cannot describe.

    A plan with a ``key_spread`` (the second-order mass shift) fills ``key_variance`` /
    ``key_radius`` (ABI 1.5); the binding loads only libraries of that ABI or later, so the
    spread is never dropped silently.
    """
    if not isinstance(plan, CorrectionPlan):
        raise TypeError(f"plan must be a CorrectionPlan, got {type(plan).__name__}")
    if pooled_e4m3 is not None and not isinstance(pooled_e4m3, PooledE4M3):
        raise TypeError(f"pooled_e4m3 must be a PooledE4M3 or None, got {type(pooled_e4m3).__name__}")
    stats = plan.statistics
    spread = plan.key_spread
    pooled_k, pooled_v = stats.pooled_k, stats.pooled_v
    if pooled_dtype is not None and pooled_e4m3 is None:
        pooled_k, pooled_v = _pooled_as(stats, pooled_dtype)
    e4m3 = (
        (pooled_e4m3.k, pooled_e4m3.vt, pooled_e4m3.offsets, pooled_e4m3.scales)
        if pooled_e4m3 is not None
        else (None,) * 4
    )
    struct = CorrectionPlanStruct(
        struct_size=ctypes.sizeof(CorrectionPlanStruct),
        chunk_size=_int32("plan.chunk_size", plan.chunk_size),
        block_size=_int32("plan.statistics.block_size", stats.block_size),
        pooled_k=tensor_desc(pooled_k, "plan.statistics.pooled_k"),
        pooled_v=tensor_desc(pooled_v, "plan.statistics.pooled_v"),
        block_lengths=tensor_desc(stats.block_lengths, "plan.statistics.block_lengths"),
        block_offsets=tensor_desc(stats.block_offsets, "plan.statistics.block_offsets"),
        todo_offsets=tensor_desc(plan.todo_offsets, "plan.todo_offsets"),
        todo_masks=tensor_desc(plan.todo_masks, "plan.todo_masks"),
        pooled_k_e4m3=tensor_desc(e4m3[0], "pooled_e4m3.k"),
        pooled_vt_e4m3=tensor_desc(e4m3[1], "pooled_e4m3.vt"),
        e4m3_offsets=tensor_desc(e4m3[2], "pooled_e4m3.offsets"),
        e4m3_scales=tensor_desc(e4m3[3], "pooled_e4m3.scales"),
        key_variance=tensor_desc(spread.variance if spread else None, "plan.key_spread.variance"),
        key_radius=tensor_desc(spread.radius if spread else None, "plan.key_spread.radius"),
    )
    _keep_alive(struct, [plan, pooled_k, pooled_v, pooled_e4m3])
    return struct


def _pooled_as(stats: BlockStatistics, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The statistics' pooled K/V in ``dtype``: their own current copies when they carry them, else converted.

    Statistics that carry copies (``fpv2.index``'s Triton pooling kernel writes bf16 ones next to
    the fp32 means, same bits as ``.to(torch.bfloat16)``) offer them through a ``pooled_in(dtype)``
    method, looked up by name (this package does not import ``fpv2.index``); it returns None once the
    copies no longer describe ``pooled_k`` / ``pooled_v`` (modified in place since pooling). Copies of
    another dtype, shape or device than the means' are not used.

    Args:
        stats: the plan's statistics.
        dtype: the dtype wanted.

    Returns:
        ``(pooled_k, pooled_v)`` in ``dtype`` (``pooled_v`` None when the statistics have none).
    """
    pooled_k, pooled_v = stats.pooled_k, stats.pooled_v
    pooled_in = getattr(stats, "pooled_in", None)
    copies = pooled_in(dtype) if pooled_in is not None else None
    if copies is not None:
        k, v = copies
        device = pooled_k.device
        if (
            k.dtype == dtype
            and k.shape == pooled_k.shape
            and k.device == device
            and (
                pooled_v is None
                or (v is not None and v.dtype == dtype and v.shape == pooled_v.shape and v.device == device)
            )
        ):
            return k, v if pooled_v is not None else None
    # Two conversion kernels (and their host time) on every call: what the copies spare.
    return pooled_k.to(dtype), pooled_v.to(dtype) if pooled_v is not None else None


def _stream_handle(stream: object, q: torch.Tensor) -> int | None:
    """Raw ``cudaStream_t`` of ``stream``; None selects q's current stream (NULL for CPU tensors)."""
    if stream is None:
        if q.is_cuda:
            # The raw handle of torch.cuda.current_stream(device).cuda_stream, without building a Stream
            # object (~0.2 against ~6.5 us of host time on the GPU machine); a CUDA tensor's device has an index.
            device = q.device
            index = device.index if device.index is not None else torch.cuda.current_device()
            return torch._C._cuda_getCurrentRawStream(index) or None
        return None
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream or None
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, int):
        return handle or None
    raise TypeError(f"stream must be None, an int handle or a torch.cuda.Stream, got {type(stream).__name__}")


def prefill_args_struct(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    index: BlockIndex | None = None,
    plan: CorrectionPlan | None = None,
    lse: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float = 0.0,
    stream: object = None,
    workspace: torch.Tensor | None = None,
    pooled_dtype: torch.dtype | None = None,
    pooled_e4m3: PooledE4M3 | None = None,
) -> PrefillArgsStruct:
    """Build ``fpv2_prefill_args_t`` for one causal prefill call (no validation: the library does it).

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache, v_cache: ``(num_pages, page_size, Hkv, d)`` paged cache.
        out: ``(total_q, Hq, d)`` output (bf16 for float8_e4m3fn inputs).
        batch: the batch metadata.
        index: the block index; None for dense causal attention.
        plan: the mean-correction plan; None for none.
        lse: optional ``(total_q, Hq) float32`` log-sum-exp output.
        q_descale, k_descale, v_descale: ``(B, Hkv) float32`` FP8 descales.
        softmax_scale: score scale; 0 selects ``1/sqrt(d)``.
        stream: a ``torch.cuda.Stream``, a raw handle, or None for q's current stream.
        workspace: optional device scratch tensor handed to the kernel.
        pooled_dtype: dtype in which the plan's pooled K/V are handed over (see
            :func:`correction_plan_struct`); None keeps float32.
        pooled_e4m3: E4M3 copies of the plan's pooled K/V (see :func:`correction_plan_struct`);
            None for none.

    Returns:
        The struct with the causal flag set, keeping every tensor and nested struct alive.

    Raises:
        TypeError: an argument has the wrong type or a dtype the ABI cannot describe.
        ValueError: a tensor has rank > 4 or a size does not fit its C field.
    """
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    batch_struct = paged_batch_struct(batch)
    index_struct = block_index_struct(index) if index is not None else None
    plan_struct = (
        correction_plan_struct(plan, pooled_dtype=pooled_dtype, pooled_e4m3=pooled_e4m3) if plan is not None else None
    )
    args = PrefillArgsStruct(
        struct_size=ctypes.sizeof(PrefillArgsStruct),
        flags=PREFILL_CAUSAL,
        q=tensor_desc(q, "q"),
        k_cache=tensor_desc(k_cache, "k_cache"),
        v_cache=tensor_desc(v_cache, "v_cache"),
        out=tensor_desc(out, "out"),
        lse=tensor_desc(lse, "lse"),
        batch=ctypes.pointer(batch_struct),
        index=ctypes.pointer(index_struct) if index_struct is not None else None,
        correction=ctypes.pointer(plan_struct) if plan_struct is not None else None,
        q_descale=tensor_desc(q_descale, "q_descale"),
        k_descale=tensor_desc(k_descale, "k_descale"),
        v_descale=tensor_desc(v_descale, "v_descale"),
        softmax_scale=float(softmax_scale),
        device=(q.device.index if q.device.index is not None else -1) if q.is_cuda else -1,
        stream=_stream_handle(stream, q),
    )
    if workspace is not None:
        # Raw scratch bytes: any dtype (torch.uint8 is the natural one), but one dense block of memory.
        if not isinstance(workspace, torch.Tensor) or not workspace.is_contiguous():
            raise TypeError(
                f"workspace must be a contiguous torch.Tensor or None; got {type(workspace).__name__}"
                + (f" with strides {workspace.stride()}" if isinstance(workspace, torch.Tensor) else "")
            )
        args.workspace = workspace.data_ptr()
        args.workspace_bytes = workspace.numel() * workspace.element_size()
    tensors = [q, k_cache, v_cache, out, lse, q_descale, k_descale, v_descale, workspace]
    _keep_alive(args, [*tensors, batch_struct, index_struct, plan_struct])
    return args
