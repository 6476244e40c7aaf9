"""E4M3 copies of the pooled block statistics for the Hopper kernel's FP8 correction, in one Triton launch.

The layout (``fpv2.h`` ABI 1.2, :mod:`fpv2.kernel.reference.pooled_e4m3`): per
(request, KV head) scales ``amax / 448``, keys ``k (rows, Hkv, d)``, values
transposed ``vt (Hkv, d, rows)`` in slot order, every request starting at a
multiple of 16 with zeros in between.

One program per (request ``b``, KV head ``h``), no host synchronisation: the
sizes come from shapes only (``rows`` is the bound of :func:`e4m3_rows`), and
each program finds its first row ``offsets[b]`` by summing the padded block
counts of the requests before it, read from ``block_offsets`` on the device.
Pass 1 takes the amax of the request's K and V blocks, pass 2 writes the
quantised blocks and the zero padding up to the next multiple of 16; the last
request's programs also zero the rows past ``offsets[B]``, so every output is
written by the kernel (``torch.empty``, no memset launches).

Under the Triton interpreter the fp32 -> e4m3 cast misrounds (it rounds half up and
loses the carry out of the mantissa: 7.92 -> 4, 31.8 -> 16), but it
converts values already on the e4m3 grid exactly (subnormals and -0 included;
checked over all 256 codes). There the values are rounded to the grid in fp32
(nearest even) first and the kernel still stores through a real
``tl.float8e4nv`` cast; compiled, the cast itself rounds (``cvt.rn.satfinite``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ..contracts._checks import describe
from ..reference.pooled_e4m3 import E4M3_GROUP, PooledE4M3, check_pooled_inputs, e4m3_rows, e4m3_slot
from .interpreter_compat import install_interpreter_index_fix
from .sparse_attention import _round_nearest_even

__all__ = ["PooledE4M3", "e4m3_rows", "e4m3_slot", "is_interpreted", "quantize_pooled_e4m3"]

#: Requests whose block counts a program sums per step when it locates its first row.
REQUESTS_PER_STEP = 64
#: Elements of one (blocks x features) tile, and the warps of a program: 64 x 64, 32 x 128 or 16 x 256 with
#: 8 warps compile for sm_90 without spills (ptxas: <= 220 registers; 8192 or 4 warps spill at d = 128).
TILE_ELEMENTS = 4096
NUM_WARPS = 8


@triton.jit
def _to_e4m3(x, scale, ROUND_IN_FP32: tl.constexpr):
    """``x / scale`` in fp32 (IEEE division, as the reference), clamped to +-448, cast to e4m3 nearest-even."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if ROUND_IN_FP32:
        # The interpreter's cast is exact on the e4m3 grid only: round there first. The sign goes back as a
        # bit (Triton negates as 0 - x, which would turn -0 into +0).
        r = _round_nearest_even(tl.abs(y), 3, -6).to(tl.int32, bitcast=True)
        y = (r | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def pooled_e4m3_kernel(
    PooledK,
    PooledV,
    BlockOffsets,
    OutK,
    OutVt,
    OutOffsets,
    OutScales,
    num_blocks,
    rows,
    num_requests,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    REQUESTS: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,
):
    """The E4M3 copies of request ``program_id(0)``, KV head ``program_id(1)`` (see the module docstring).

    ``BLOCK`` (a multiple of 16) blocks are handled per step, so a step's columns of
    ``vt`` are the slots of its own blocks. ``D_P2`` is a power of two >= ``HEAD_DIM``.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    # This request's first row: the padded block counts of the requests before it.
    first = b * 0
    offs_r = tl.arange(0, REQUESTS)
    for r0 in range(0, b, REQUESTS):
        r = r0 + offs_r
        before = r < b
        lo = tl.load(BlockOffsets + r, mask=before, other=0)
        hi = tl.load(BlockOffsets + r + 1, mask=before, other=0)
        first += tl.sum((hi - lo + 15) // 16 * 16, 0)
    start = tl.load(BlockOffsets + b)
    n = tl.load(BlockOffsets + b + 1) - start
    padded = (n + 15) // 16 * 16
    tl.store(OutOffsets + b + 1, first + padded, mask=h == 0)
    tl.store(OutOffsets + b, first, mask=(h == 0) & (b == 0))

    offs_j = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D_P2)
    d_ok = (offs_d < HEAD_DIM)[None, :]
    row_stride = NUM_KV_HEADS * HEAD_DIM
    feature = h * HEAD_DIM + offs_d[None, :]

    # Pass 1: amax over the request's blocks and features.
    amax_k = tl.zeros([BLOCK, D_P2], tl.float32)
    amax_v = tl.zeros([BLOCK, D_P2], tl.float32)
    for j0 in range(0, n, BLOCK):
        j = j0 + offs_j
        ok = ((j < n) & (start + j < num_blocks))[:, None] & d_ok
        src = (start + j).to(tl.int64)[:, None] * row_stride + feature
        amax_k = tl.maximum(amax_k, tl.abs(tl.load(PooledK + src, mask=ok, other=0.0).to(tl.float32)))
        amax_v = tl.maximum(amax_v, tl.abs(tl.load(PooledV + src, mask=ok, other=0.0).to(tl.float32)))
    amax_k = tl.max(tl.max(amax_k, 1), 0)
    amax_v = tl.max(tl.max(amax_v, 1), 0)
    scale_k = tl.where(amax_k == 0, 1.0, tl.math.div_rn(amax_k, 448.0))
    scale_v = tl.where(amax_v == 0, 1.0, tl.math.div_rn(amax_v, 448.0))
    tl.store(OutScales + (b * NUM_KV_HEADS + h) * 2, scale_k)
    tl.store(OutScales + (b * NUM_KV_HEADS + h) * 2 + 1, scale_v)

    # Pass 2: blocks and their zero padding. Column c of a step holds the block whose slot is c
    # (the inverse of e4m3_slot: slot 4t + i holds block 2t + i for i < 2, 8 + 2t + i - 2 for i >= 2).
    within = offs_j % 16
    slot_block = offs_j - within + 2 * (within // 4) + within % 2 + 8 * ((within % 4) // 2)
    vt_head = OutVt + h.to(tl.int64) * HEAD_DIM * rows
    vt_feature = offs_d.to(tl.int64)[None, :] * rows
    for j0 in range(0, padded, BLOCK):
        j = j0 + offs_j
        dst = first + j
        dst_ok = ((j < padded) & (dst < rows))[:, None] & d_ok
        ok = ((j < n) & (start + j < num_blocks))[:, None] & d_ok
        src = (start + j).to(tl.int64)[:, None] * row_stride + feature
        x = tl.load(PooledK + src, mask=ok, other=0.0)
        tl.store(OutK + dst.to(tl.int64)[:, None] * row_stride + feature, _to_e4m3(x, scale_k, ROUND_IN_FP32), dst_ok)
        jv = j0 + slot_block
        ok_v = ((jv < n) & (start + jv < num_blocks))[:, None] & d_ok
        src_v = (start + jv).to(tl.int64)[:, None] * row_stride + feature
        v = tl.load(PooledV + src_v, mask=ok_v, other=0.0)
        tl.store(vt_head + vt_feature + dst.to(tl.int64)[:, None], _to_e4m3(v, scale_v, ROUND_IN_FP32), dst_ok)

    # Rows past the last request (up to the shape's bound): zeros, written by the last request's programs.
    zeros = tl.zeros([BLOCK, D_P2], tl.float32).to(tl.float8e4nv)
    tail = tl.where(b == num_requests - 1, first + padded, rows)
    for r0 in range(tail, rows, BLOCK):
        dst = r0 + offs_j
        dst_ok = (dst < rows)[:, None] & d_ok
        tl.store(OutK + dst.to(tl.int64)[:, None] * row_stride + feature, zeros, dst_ok)
        tl.store(vt_head + vt_feature + dst.to(tl.int64)[:, None], zeros, dst_ok)


def is_interpreted() -> bool:
    """Whether the quantisation kernel runs under the Triton interpreter (``TRITON_INTERPRET=1`` at import).

    Returns:
        True when it runs on the CPU through the interpreter.
    """
    return isinstance(pooled_e4m3_kernel, InterpretedFunction)


def quantize_pooled_e4m3(pooled_k: torch.Tensor, pooled_v: torch.Tensor, block_offsets: torch.Tensor) -> PooledE4M3:
    """E4M3 copies of pooled K/V for the Hopper kernel's FP8 correction, without a host synchronisation.

    Same result, bit for bit, as
    :func:`~fpv2.kernel.reference.pooled_e4m3.quantize_pooled_e4m3_reference`: scales
    ``amax / 448`` per (request, KV head) and tensor (1 for an amax of 0 or a request
    without blocks), values divided by their scale in fp32, clamped to +-448 and
    rounded to nearest even; ``k`` in block order, ``vt`` transposed in slot order
    (:func:`e4m3_slot`), each request at a multiple of 16, zeros elsewhere. One
    launch, asynchronous on the current stream; the outputs are freshly allocated.

    ``block_offsets`` must run from 0 to at most ``T``, non-decreasing (as
    :class:`~fpv2.kernel.BlockStatistics` keeps them); that is not checked (it would
    need a sync), but no access leaves the tensors either way. Inputs are assumed
    finite: how NaN enters a scale is unspecified here.

    Args:
        pooled_k, pooled_v: ``(T, Hkv, d)`` float32 or bfloat16, contiguous, same shape, dtype and device.
        block_offsets: ``(B+1,) int32``: request ``b``'s blocks are rows
            ``block_offsets[b] .. block_offsets[b+1]``.

    Returns:
        The copies on the inputs' device, with ``rows = 16 * ceil((T + 15 B) / 16)``.

    Raises:
        TypeError: an argument is not a tensor or has the wrong dtype.
        ValueError: wrong ranks, shapes, devices or strides, or CPU tensors without the interpreter.
    """
    num_blocks, num_kv_heads, head_dim, num_requests = check_pooled_inputs(pooled_k, pooled_v, block_offsets)
    interpreted = is_interpreted()
    if pooled_k.device.type != "cuda" and not interpreted:
        raise ValueError(
            "quantize_pooled_e4m3 needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run on "
            f"the CPU; pooled_k has {describe(pooled_k)}"
        )
    if interpreted:
        install_interpreter_index_fix()
    device = pooled_k.device
    rows = e4m3_rows(num_blocks, num_requests)
    k = torch.empty(rows, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
    vt = torch.empty(num_kv_heads, head_dim, rows, dtype=torch.float8_e4m3fn, device=device)
    offsets = torch.empty(num_requests + 1, dtype=torch.int32, device=device)
    scales = torch.empty(num_requests, num_kv_heads, 2, dtype=torch.float32, device=device)
    d_p2 = triton.next_power_of_2(head_dim)
    block = max(E4M3_GROUP, min(64, TILE_ELEMENTS // d_p2))
    # Triton launches on the current device: make it the tensors' one (a no-op in the usual single-GPU process).
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        pooled_e4m3_kernel[(num_requests, num_kv_heads)](
            pooled_k,
            pooled_v,
            block_offsets,
            k,
            vt,
            offsets,
            scales,
            num_blocks,
            rows,
            num_requests,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            D_P2=d_p2,
            BLOCK=block,
            REQUESTS=REQUESTS_PER_STEP,
            ROUND_IN_FP32=interpreted,
            num_warps=NUM_WARPS,
        )
    return PooledE4M3(k, vt, offsets, scales)
