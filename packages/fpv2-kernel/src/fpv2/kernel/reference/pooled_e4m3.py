"""E4M3 copies of the pooled block statistics, the layout the Hopper kernel's FP8 correction reads.

The mean correction multiplies each query tile by the pooled keys of the pruned
blocks and the resulting probabilities by their pooled values. The Hopper
kernel can run both products on FP8 tensor cores from copies of the pooled
statistics quantised once per call (``fpv2.h``, ABI 1.2):

* one scale per (request, KV head) and tensor, ``amax / 448`` over the request's
  blocks and all features (1 when the amax is 0), so a request's largest pooled
  magnitude maps onto the largest finite e4m3 value;
* keys ``k (rows, Hkv, d)``: request ``b``'s block ``J`` is row ``offsets[b] + J``;
* values transposed, ``vt (Hkv, d, rows)`` with the blocks contiguous (8-bit
  wgmma reads both operands K-major): block ``J`` is column
  ``offsets[b] + e4m3_slot(J)``;
* every request starts at a multiple of 16 (``offsets[b+1] = offsets[b] +
  16 * ceil(n_b / 16)``) and the rows or columns no block fills hold zeros.

This module holds the container, the slot order and the PyTorch reference of
the quantisation; the sync-free Triton kernel that serves the native binding is
:func:`fpv2.kernel.triton.pooled_e4m3.quantize_pooled_e4m3`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from ..contracts._checks import check_contiguous, check_shape, check_tensor, describe
from .fp8 import descale_from_amax, saturate_to_e4m3

#: Blocks per slot group: every request's rows start at a multiple of this.
E4M3_GROUP = 16

_Index = TypeVar("_Index", int, torch.Tensor)


@dataclass(frozen=True, eq=False)
class PooledE4M3:
    """E4M3 copies of a plan's pooled K/V (the ``*_e4m3`` tensors of ``fpv2_correction_plan_t``).

    Args:
        k: ``(rows, Hkv, d) float8_e4m3fn``: request ``b``'s block ``J`` is row ``offsets[b] + J``,
            holding ``pooled_k / scales[b, h, 0]``.
        vt: ``(Hkv, d, rows) float8_e4m3fn``, contiguous: block ``J`` is column
            ``offsets[b] + e4m3_slot(J)``, holding ``pooled_v / scales[b, h, 1]``.
        offsets: ``(B+1,) int32`` first row of each request, multiples of 16.
        scales: ``(B, Hkv, 2) float32``: the K and V scale of each (request, KV head).
    """

    k: torch.Tensor
    vt: torch.Tensor
    offsets: torch.Tensor
    scales: torch.Tensor

    @property
    def rows(self) -> int:
        """Rows of ``k`` (columns of ``vt``): a multiple of 16 covering every request's blocks."""
        return self.k.shape[0]


def e4m3_slot(j: _Index) -> _Index:
    """Column of block ``j`` in ``vt``, relative to its request's offset (``FPV2_E4M3_SLOT`` of ``fpv2.h``).

    Within each group of 16 blocks, block ``j`` goes to slot ``4 * (j // 2) + j % 2`` for
    ``j < 8`` and ``4 * ((j - 8) // 2) + 2 + (j - 8) % 2`` for ``j >= 8``; groups keep their place.

    Args:
        j: a block index ``>= 0``, or an integer tensor of them.

    Returns:
        The slot, of the same kind as ``j``.

    Raises:
        ValueError: ``j`` is a negative int.
    """
    # Why the order: the Hopper kernel reuses the fp32 accumulator registers of P = softmax(Q K^T) in place as
    # the FP8 A operand of P x V. A thread's accumulator holds keys 2t, 2t+1, 2t+8, 2t+9 of each 16-key group,
    # while an 8-bit A fragment wants 4 consecutive K indices there: slot 4t + i holds key 2t + i (i < 2) or
    # 8 + 2t + i - 2 (i >= 2), so storing V^T in slot order lets P feed the product without a shuffle.
    if isinstance(j, int) and j < 0:
        raise ValueError(f"e4m3_slot needs a block index >= 0; got {j}")
    r = j % E4M3_GROUP
    return E4M3_GROUP * (j // E4M3_GROUP) + 4 * ((r % 8) // 2) + 2 * (r // 8) + r % 2


def e4m3_rows(num_blocks: int, num_requests: int) -> int:
    """Rows of the E4M3 copies: ``16 * ceil((T + 15 * B) / 16)``, enough for any split of T blocks.

    Each request pads its blocks to a multiple of 16, adding at most 15 rows, so the bound
    needs the shapes only (no read of ``block_offsets``).

    Args:
        num_blocks: ``T``, the pooled blocks of the batch.
        num_requests: ``B``.

    Returns:
        The row count, a multiple of 16.
    """
    padded = num_blocks + (E4M3_GROUP - 1) * num_requests
    return E4M3_GROUP * -(-padded // E4M3_GROUP)


def check_pooled_inputs(pooled_k: object, pooled_v: object, block_offsets: object) -> tuple[int, int, int, int]:
    """Check the inputs of a pooled quantisation (metadata only, no sync).

    Args:
        pooled_k, pooled_v: ``(T, Hkv, d)`` float32 or bfloat16, contiguous, alike in shape, dtype, device.
        block_offsets: ``(B+1,) int32`` on the same device, contiguous, ``B >= 1``.

    Returns:
        ``(T, Hkv, d, B)``.

    Raises:
        TypeError: not tensors, or wrong dtypes.
        ValueError: wrong ranks, shapes, devices or strides.
    """
    pk = check_tensor("pooled_k", pooled_k, dtypes=(torch.float32, torch.bfloat16), ndim=3)
    pv = check_tensor("pooled_v", pooled_v, dtypes=(pk.dtype,), ndim=3, device=pk.device)
    check_shape("pooled_v", pv, tuple(pk.shape))
    offsets = check_tensor("block_offsets", block_offsets, dtypes=(torch.int32,), ndim=1, device=pk.device)
    if offsets.shape[0] < 2:
        raise ValueError(f"block_offsets must have B+1 >= 2 entries (one request at least); got {describe(offsets)}")
    for name, t in (("pooled_k", pk), ("pooled_v", pv), ("block_offsets", offsets)):
        check_contiguous(name, t)
    num_blocks, num_kv_heads, head_dim = pk.shape
    return num_blocks, num_kv_heads, head_dim, offsets.shape[0] - 1


def quantize_pooled_e4m3_reference(
    pooled_k: torch.Tensor, pooled_v: torch.Tensor, block_offsets: torch.Tensor
) -> PooledE4M3:
    """The E4M3 copies of pooled K/V, written out request by request (reads ``block_offsets`` on the host).

    Values are divided by their scale in fp32, clamped to +-448 and rounded to nearest
    even (torch's cast). Non-finite inputs propagate into their request's scales.

    Args:
        pooled_k, pooled_v: ``(T, Hkv, d)`` float32 or bfloat16 (as in :class:`~fpv2.kernel.BlockStatistics`).
        block_offsets: ``(B+1,) int32``: request ``b``'s blocks are rows ``block_offsets[b] .. block_offsets[b+1]``.

    Returns:
        The copies, on the inputs' device, with ``e4m3_rows(T, B)`` rows.

    Raises:
        TypeError, ValueError: malformed inputs (the message names the argument).
    """
    num_blocks, num_kv_heads, head_dim, num_requests = check_pooled_inputs(pooled_k, pooled_v, block_offsets)
    device = pooled_k.device
    rows = e4m3_rows(num_blocks, num_requests)
    k = torch.zeros(rows, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device=device)
    vt = torch.zeros(num_kv_heads, head_dim, rows, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.ones(num_requests, num_kv_heads, 2, dtype=torch.float32, device=device)
    bounds = block_offsets.tolist()
    offsets = [0]
    for b in range(num_requests):
        start, end = bounds[b], bounds[b + 1]
        n = end - start
        first = offsets[-1]
        offsets.append(first + E4M3_GROUP * -(-n // E4M3_GROUP))
        if n <= 0:
            continue
        slots = first + e4m3_slot(torch.arange(n, device=device))
        for which, (src, dst) in enumerate(((pooled_k, "k"), (pooled_v, "vt"))):
            x = src[start:end].float()  # (n, Hkv, d)
            scale = descale_from_amax(x.abs().amax(dim=(0, 2)))
            scales[b, :, which] = scale
            q = saturate_to_e4m3(x / scale[None, :, None])
            if dst == "k":
                k[first : first + n] = q
            else:
                vt[:, :, slots] = q.permute(1, 2, 0)
    return PooledE4M3(k, vt, torch.tensor(offsets, dtype=torch.int32, device=device), scales)


def dequantize_pooled_e4m3(pooled: PooledE4M3, block_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled K/V back from their E4M3 copies (``e4m3 * scale``, V read through the slots), in float32.

    Args:
        pooled: the copies.
        block_offsets: ``(B+1,) int32`` of the statistics they were made from.

    Returns:
        ``(pooled_k, pooled_v)``, each ``(T, Hkv, d) float32`` with ``T = block_offsets[-1]``.
    """
    bounds, offsets = block_offsets.tolist(), pooled.offsets.tolist()
    parts_k, parts_v = [], []
    for b in range(len(bounds) - 1):
        n, first = bounds[b + 1] - bounds[b], offsets[b]
        slots = first + e4m3_slot(torch.arange(max(n, 0), device=pooled.k.device))
        parts_k.append(pooled.k[first : first + n].float() * pooled.scales[b, None, :, 0, None])
        parts_v.append(pooled.vt[:, :, slots].float().permute(2, 0, 1) * pooled.scales[b, None, :, 1, None])
    return torch.cat(parts_k), torch.cat(parts_v)
