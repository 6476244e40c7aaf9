"""Paged mean pooling of K and V: one Triton program per (key block, group of KV heads), one launch in all.

Each program finds its request with a vector prefix sum over ``seqlens_k``
(no host-built block-to-request table), reads its block's tokens straight out
of the paged cache through the page table (any page size, 1 included),
dequantises FP8 with the per (request, KV head) descale, accumulates in fp32
and divides by the block's valid length, so the tail block of a request
averages over its real tokens. Output rows follow
:class:`fpv2.kernel.BlockStatistics`: block ``J`` of request ``b`` is row
``block_offsets[b] + J``; program ``(0, 0)`` writes ``block_offsets`` itself.

With ``HAS_KEYS`` the kernel also writes the scoring copy of the pooled keys
(:mod:`.prepared_keys`): the stored fp32 mean times ``key_scale``, cast to the
keys' dtype, which is what the separate preparation kernel computes from the
stored mean (same product, same rounding), so the selection needs no launch of
its own for it. With ``HAS_COPIES`` it also writes bf16 copies of the pooled K
and V (the operands of the Hopper kernel's correction, which would otherwise
convert the fp32 means itself on every call): the stored fp32 means rounded to
nearest even, bit for bit what ``torch.Tensor.to(torch.bfloat16)`` makes of
them (:func:`_bf16_rne`). All outputs of a call come from one allocation
(:mod:`.outputs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fpv2.kernel.triton.relaunch import Relauncher
from fpv2.kernel.triton.tile_repack import TileRepacked

from . import tuning
from .outputs import fresh_outputs
from .tuning import next_power_of_2


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16, round to nearest even, in integer operations (the same bits on the GPU and the interpreter).

    The interpreter's own cast truncates; this is torch's rounding (``c10::BFloat16``'s
    ``round_to_nearest_even``, ``cvt.rn.bf16.f32`` on the GPU): infinities stay infinite,
    values rounding past the largest finite bf16 become infinite, NaN becomes the GPU's
    canonical NaN ``0x7FFF`` (the CPU's conversion writes ``0x7FC0``: another NaN).
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FFF, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _pool_kernel(
    k_ptr,
    v_ptr,
    pooled_k_ptr,
    pooled_v_ptr,
    keys_ptr,
    k_copy_ptr,
    v_copy_ptr,
    lengths_ptr,
    block_offsets_ptr,
    seqlens_k_ptr,
    page_table_ptr,
    k_descale_ptr,
    v_descale_ptr,
    k_tiles_ptr,
    v_tiles_ptr,
    tile_table_ptr,
    stride_tile_table,
    stride_k_page,
    stride_k_slot,
    stride_k_head,
    stride_v_page,
    stride_v_slot,
    stride_v_head,
    stride_table,
    page_size,
    num_requests,
    num_kv_heads,
    head_dim,
    key_scale,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    HEADS: tl.constexpr,
    HAS_V: tl.constexpr,
    HAS_K_DESCALE: tl.constexpr,
    HAS_V_DESCALE: tl.constexpr,
    HAS_KEYS: tl.constexpr,
    HAS_COPIES: tl.constexpr,
    HAS_TILES: tl.constexpr,
):
    row = tl.program_id(0)  # global block row (block_offsets[b] + J)
    group = tl.program_id(1)  # heads group * HEADS .. group * HEADS + HEADS - 1
    # ---- the request of this row: prefix sum of blocks per request (B lanes)
    req = tl.arange(0, BLOCK_B)
    req_ok = req < num_requests
    lens = tl.load(seqlens_k_ptr + req, mask=req_ok, other=0)
    nblocks = (lens + (BLOCK_SIZE - 1)) // BLOCK_SIZE
    ends = tl.cumsum(nblocks, axis=0)
    b = tl.sum((req_ok & (ends <= row)).to(tl.int32), axis=0)
    sel = req == b
    kv_len = tl.sum(tl.where(sel, lens, 0), axis=0)
    block = row - tl.sum(tl.where(sel, ends - nblocks, 0), axis=0)
    writer = (row == 0) & (group == 0)
    tl.store(block_offsets_ptr + 1 + req, ends, mask=req_ok & writer)
    tl.store(block_offsets_ptr + req, req * 0, mask=(req == 0) & writer)

    start = block * BLOCK_SIZE
    length = tl.minimum(kv_len - start, BLOCK_SIZE)
    # Columns: HEADS heads of BLOCK_D dims each (all heads of a token are one contiguous row for HEADS = Hkv).
    cols = tl.arange(0, HEADS * BLOCK_D)
    heads = group * HEADS + cols // BLOCK_D
    dims = cols % BLOCK_D
    col_ok = (dims < head_dim) & (heads < num_kv_heads)
    k_cols = heads.to(tl.int64) * stride_k_head + dims
    v_cols = heads.to(tl.int64) * stride_v_head + dims
    acc_k = tl.zeros([HEADS * BLOCK_D], dtype=tl.float32)
    acc_v = tl.zeros([HEADS * BLOCK_D], dtype=tl.float32)
    table_row = page_table_ptr + b.to(tl.int64) * stride_table
    if HAS_TILES:
        # Block row `row` is tile page `row` (Bk = 128 and both number the requests' blocks in batch order): its
        # token t goes to row t of the page, all heads of a token one contiguous row; request b's page `block`
        # of the tile page table is `row`.
        tile_cols = heads * head_dim + dims
        tile_rows = row.to(tl.int64) * BLOCK_SIZE
        tl.store(tile_table_ptr + b.to(tl.int64) * stride_tile_table + block, row, mask=group == 0)
    # Static trip count: the Triton 3.6 interpreter cannot take loaded values as range() bounds.
    for t0 in range(0, BLOCK_SIZE, TOKENS):
        offs = t0 + tl.arange(0, TOKENS)
        tok_ok = offs < length
        pos = start + offs
        # Page ids are only read for valid tokens: entries past a request's last page may be garbage.
        page = tl.load(table_row + pos // page_size, mask=tok_ok, other=0).to(tl.int64)
        slot = (pos % page_size).to(tl.int64)
        mask = tok_ok[:, None] & col_ok[None, :]
        k_rows = page * stride_k_page + slot * stride_k_slot
        k = tl.load(k_ptr + k_rows[:, None] + k_cols[None, :], mask=mask, other=0.0)
        acc_k += tl.sum(k.to(tl.float32), axis=0)
        if HAS_TILES:  # the tile pages' copy of the raw tokens (zeros past the request's length)
            tile_at = (tile_rows + offs)[:, None] * (num_kv_heads * head_dim) + tile_cols[None, :]
            tl.store(k_tiles_ptr + tile_at, k, mask=col_ok[None, :])
        if HAS_V:
            v_rows = page * stride_v_page + slot * stride_v_slot
            v = tl.load(v_ptr + v_rows[:, None] + v_cols[None, :], mask=mask, other=0.0)
            acc_v += tl.sum(v.to(tl.float32), axis=0)
            if HAS_TILES:
                tl.store(v_tiles_ptr + tile_at, v, mask=col_ok[None, :])

    inv_len = 1.0 / length.to(tl.float32)
    k_scale = inv_len
    if HAS_K_DESCALE:
        k_scale = inv_len * tl.load(k_descale_ptr + b * num_kv_heads + heads, mask=col_ok, other=0.0)
    out = (row.to(tl.int64) * num_kv_heads + heads) * head_dim + dims
    mean_k = acc_k * k_scale
    tl.store(pooled_k_ptr + out, mean_k, mask=col_ok)
    if HAS_KEYS:  # the scoring copy: (stored mean * scale) in the keys' dtype, as the preparation kernel makes it
        tl.store(keys_ptr + out, (mean_k * key_scale).to(keys_ptr.dtype.element_ty), mask=col_ok)
    if HAS_COPIES:  # the bf16 copy of the very fp32 value stored above
        tl.store(k_copy_ptr + out, _bf16_rne(mean_k), mask=col_ok)
    if HAS_V:
        v_scale = inv_len
        if HAS_V_DESCALE:
            v_scale = inv_len * tl.load(v_descale_ptr + b * num_kv_heads + heads, mask=col_ok, other=0.0)
        mean_v = acc_v * v_scale
        tl.store(pooled_v_ptr + out, mean_v, mask=col_ok)
        if HAS_COPIES:
            tl.store(v_copy_ptr + out, _bf16_rne(mean_v), mask=col_ok)
    tl.store(lengths_ptr + row, length, mask=group == 0)


#: The pooling kernel's launcher (direct relaunch of the compiled kernel, :mod:`.launcher`).
_POOL = Relauncher(_pool_kernel)


def launch_pool(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    *,
    seqlens_k: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    total_blocks: int,
    block_size: int,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    key_dtype: torch.dtype | None = None,
    key_scale: float = 1.0,
    copies: bool = False,
    tile_copies: TileRepacked | None = None,
) -> tuple[
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor,
    torch.Tensor,
]:
    """Run the pooling kernel over every block of the batch (inputs checked by the caller).

    Args:
        k_cache: ``(num_pages, page_size, Hkv, d)`` key cache, unit stride in ``d``.
        v_cache: same layout, or None to pool keys only.
        seqlens_k: ``(B,) int32`` KV lengths.
        page_table: ``(B, max_pages) int32`` page table, unit stride along pages.
        page_size: tokens per page.
        total_blocks: number of block rows (from the batch's host copy of ``seqlens_k``).
        block_size: tokens per block.
        k_descale: ``(B, Hkv) float32`` contiguous or None.
        v_descale: ``(B, Hkv) float32`` contiguous or None.
        key_dtype: dtype of the scoring copy of the pooled keys, or None for no copy.
        key_scale: factor of the scoring copy (:func:`.prepared_keys.logit_scale_log2`).
        copies: also write bf16 copies of the pooled K (and V) (:func:`_bf16_rne` of the stored means).
        tile_copies: tile pages to fill with the raw K and V tokens and their page table, as
            :func:`fpv2.kernel.triton.tile_repack.repack_to_tile_pages` would (checked by the caller: needs
            ``v_cache`` and ``block_size = 128``).

    Returns:
        ``(pooled_k, pooled_v or None, keys or None, k_copy or None, v_copy or None, block_lengths,
        block_offsets)``: ``(total_blocks, Hkv, d) float32`` pooled vectors, the ``(total_blocks, Hkv, d)``
        scoring copy in ``key_dtype``, the ``(total_blocks, Hkv, d) bfloat16`` copies of the pooled K and V
        (``v_copy`` only with ``v_cache``), ``(total_blocks,) int32`` valid tokens per block and ``(B+1,) int32``
        cumulative blocks per request; fresh tensors sharing one allocation.
    """
    _, _, num_kv_heads, head_dim = k_cache.shape
    device = k_cache.device
    num_requests = seqlens_k.numel()
    shape = (total_blocks, num_kv_heads, head_dim)
    has_v = v_cache is not None
    # Optional parts are None slots: one list of (shape, dtype) or None, carved in one allocation.
    wanted = [
        (shape, torch.float32),
        (shape, torch.float32) if has_v else None,
        (shape, key_dtype) if key_dtype is not None else None,
        (shape, torch.bfloat16) if copies else None,
        (shape, torch.bfloat16) if copies and has_v else None,
        ((total_blocks,), torch.int32),
        ((num_requests + 1,), torch.int32),
    ]
    carved = iter(fresh_outputs(device, [part for part in wanted if part is not None]))
    pooled_k, pooled_v, keys, k_copy, v_copy, lengths, block_offsets = (
        next(carved) if part is not None else None for part in wanted
    )
    if total_blocks == 0 or num_kv_heads == 0:
        block_offsets.zero_()
        return pooled_k, pooled_v, keys, k_copy, v_copy, lengths, block_offsets
    knobs = tuning.POOL
    v_arg = v_cache if v_cache is not None else k_cache
    heads = knobs.heads_for(num_kv_heads, next_power_of_2(head_dim))
    _POOL(
        (total_blocks, -(-num_kv_heads // heads)),
        k_cache,
        v_arg,
        pooled_k,
        pooled_v if pooled_v is not None else pooled_k,
        keys if keys is not None else pooled_k,
        k_copy if k_copy is not None else pooled_k,
        v_copy if v_copy is not None else pooled_k,
        lengths,
        block_offsets,
        seqlens_k,
        page_table,
        k_descale if k_descale is not None else pooled_k,
        v_descale if v_descale is not None else pooled_k,
        tile_copies.k_cache if tile_copies is not None else pooled_k,
        tile_copies.v_cache if tile_copies is not None else pooled_k,
        tile_copies.batch.page_table if tile_copies is not None else lengths,
        tile_copies.batch.page_table.stride(0) if tile_copies is not None else 0,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_arg.stride(0),
        v_arg.stride(1),
        v_arg.stride(2),
        page_table.stride(0),
        page_size,
        num_requests,
        num_kv_heads,
        head_dim,
        float(key_scale),
        BLOCK_SIZE=block_size,
        TOKENS=knobs.tokens_for(page_size, block_size),
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_B=max(2, next_power_of_2(num_requests)),
        HEADS=heads,
        HAS_V=v_cache is not None,
        HAS_K_DESCALE=k_descale is not None,
        HAS_V_DESCALE=v_descale is not None,
        HAS_KEYS=keys is not None,
        HAS_COPIES=copies,
        HAS_TILES=tile_copies is not None,
        num_warps=knobs.num_warps,
    )
    return pooled_k, pooled_v, keys, k_copy, v_copy, lengths, block_offsets
