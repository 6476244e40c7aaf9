"""The index stage's block scoring on Hopper through the C ABI (``fpv2_score_blocks``, ABI 1.4).

One call scores every (request, KV head, query tile) segment of a batch against the request's pooled keys
and writes the keep bits, counts, CSR offsets and tile offsets that ``fpv2.index`` compacts into a
:class:`~fpv2.kernel.BlockIndex`: the same rule as the index's fused Triton pass (see ``fpv2.h``), on
wgmma. Asynchronous on the stream, no host sync.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from .api import check_status
from .library import load_native_library
from .structs import ScoreArgsStruct, _int32, _keep_alive, _stream_handle, tensor_desc

#: Largest key-block count of a request the kernel takes (its energies live in shared memory).
SCORE_MAX_BLOCKS = 16384
#: Head dims and query dtypes the kernel is built for.
SCORE_HEAD_DIMS = (64, 128)
SCORE_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ScoreRule:
    """The selection rule's scalars (``fpv2.index.IndexConfig``'s, with the sink in whole blocks).

    Attributes:
        alpha: keep blocks whose energy is at least ``alpha`` times the tile's largest.
        block_size: KV tokens per key block (a power of two).
        sink_blocks: leading blocks always kept.
        window_tokens: tokens before a tile's first position whose blocks are always kept.
        dense_tail_tiles: last tiles of every request kept dense.
        min_sparse_kv_len: requests with fewer keys are kept dense.
    """

    alpha: float
    block_size: int
    sink_blocks: int = 0
    window_tokens: int = 0
    dense_tail_tiles: int = 0
    min_sparse_kv_len: int = 0


def score_args_struct(
    q: torch.Tensor,
    keys: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_offsets: torch.Tensor,
    tile_offsets: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    keep_bits: torch.Tensor,
    num_tiles: int,
    max_blocks: int,
    rule: ScoreRule,
    tile_size: int = 128,
    stream: object = None,
) -> ScoreArgsStruct:
    """Build the ``fpv2_score_args_t`` of one call (metadata only; the struct keeps the tensors alive).

    Args: as :func:`score_blocks`.

    Returns:
        The struct, ``struct_size`` set.
    """
    heads = keys.shape[1] if keys.dim() == 3 else 1
    group = q.shape[1] // heads if q.dim() == 3 and heads else 0
    tensors = (q, keys, cu_seqlens_q, seqlens_k, block_offsets, tile_offsets, offsets, counts, keep_bits)
    names = ("q", "keys", "cu_seqlens_q", "seqlens_k", "block_offsets", "tile_offsets", "offsets", "counts",
             "keep_bits")  # fmt: skip
    descs = [tensor_desc(t, name) for t, name in zip(tensors, names, strict=True)]
    args = ScoreArgsStruct(
        ctypes.sizeof(ScoreArgsStruct),
        _int32("num_requests", cu_seqlens_q.numel() - 1),
        *descs,
        _int32("group", group),
        _int32("tile_size", tile_size),
        _int32("block_size", rule.block_size),
        _int32("max_blocks", max_blocks),
        num_tiles,
        float(rule.alpha),
        _int32("sink_blocks", rule.sink_blocks),
        _int32("window_tokens", rule.window_tokens),
        _int32("dense_tail_tiles", rule.dense_tail_tiles),
        _int32("min_sparse_kv_len", min(rule.min_sparse_kv_len, 2**31 - 1)),
        q.device.index if q.is_cuda and q.device.index is not None else -1,
        _stream_handle(stream, q),
    )
    _keep_alive(args, tensors)
    return args


def score_blocks(
    q: torch.Tensor,
    keys: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_offsets: torch.Tensor,
    tile_offsets: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    keep_bits: torch.Tensor,
    num_tiles: int,
    max_blocks: int,
    rule: ScoreRule,
    tile_size: int = 128,
    stream: object = None,
) -> None:
    """Score and select every segment's key blocks with the Hopper kernel (``fpv2_score_blocks``).

    Writes ``keep_bits`` (bit ``i`` of word ``w`` of segment ``s`` keeps block ``32 w + i``; whole 64-block
    chunks up to the tile's visible blocks), ``counts``, ``offsets = [0, cumsum(counts)]`` and
    ``tile_offsets``. Segment order: request, KV head, tile (the block index's).

    Args:
        q: ``(total_q, Hq, d)`` bf16 or fp16 packed queries, unit stride in ``d``; d in {64, 128}.
        keys: ``(total_blocks, Hkv, d)`` contiguous pooled keys in q's dtype, prescaled by
            ``softmax_scale * log2(e)`` (``fpv2.index``'s prepared keys).
        cu_seqlens_q: ``(B+1,) int32`` query offsets.
        seqlens_k: ``(B,) int32`` KV lengths.
        block_offsets: ``(B+1,) int32`` first pooled row of each request.
        tile_offsets: ``(B+1,) int32`` output.
        offsets: ``(S+1,) int32`` output, ``S = Hkv * num_tiles``.
        counts: ``(S,) int32`` output.
        keep_bits: ``(S, words) int32`` output, unit inner stride, ``words >= 2 * ceil(max_blocks / 64)``.
        num_tiles: query tiles of the batch (``sum_b ceil(q_len_b * g / tile_size)``).
        max_blocks: key blocks of the longest request (at most :data:`SCORE_MAX_BLOCKS`).
        rule: the selection rule.
        tile_size: packed rows per tile (128 only).
        stream: CUDA stream; None uses q's current stream.

    Raises:
        ValueError, UnsupportedConfigurationError: invalid or unsupported arguments (the message names them).
        HopperKernelNotBuiltError: the library was built without the Hopper code.
        NativeError: a CUDA failure.
        NativeLibraryError: the library is not available.
    """
    if not math.isfinite(rule.alpha):
        raise ValueError(f"rule.alpha must be finite, got {rule.alpha}")
    args = score_args_struct(
        q, keys, cu_seqlens_q=cu_seqlens_q, seqlens_k=seqlens_k, block_offsets=block_offsets,
        tile_offsets=tile_offsets, offsets=offsets, counts=counts, keep_bits=keep_bits, num_tiles=num_tiles,
        max_blocks=max_blocks, rule=rule, tile_size=tile_size, stream=stream,
    )  # fmt: skip
    check_status(load_native_library().fpv2_score_blocks(ctypes.byref(args)))


def validate_score_blocks(args: ScoreArgsStruct) -> None:
    """Run the library's metadata checks of ``fpv2_score_blocks`` alone (nothing is launched).

    Raises:
        ValueError, UnsupportedConfigurationError: what ``fpv2_score_blocks`` would refuse.
    """
    check_status(load_native_library().fpv2_validate_score_blocks(ctypes.byref(args)))
