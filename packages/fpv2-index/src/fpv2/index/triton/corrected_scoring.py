"""Scoring pass 1 that also accumulates the mean correction's pooled terms (opt-in building block).

The mean correction adds every *eligible* pruned block ``J`` (fully visible to the
tile's first row) to a query row's softmax as one pooled term: logit
``q . mean(K_J) * scale + log |B_J|``, value ``mean(V_J)``. Those logits are the
scoring pass's own logits, so the pass that scores a tile can also accumulate
the pooled terms, once, for all eligible blocks, instead of the attention kernel
recomputing them for the blocks the selection prunes.

This module is pass 1 of that design, as a separate Triton kernel with one
program per (query tile, KV head, request):

* logits ``s_rJ`` in log2 units (the prepared keys carry ``scale * log2 e``),
  laid out (row, block) so each row keeps a running maximum ``m_r`` as in an
  online softmax;
* each scored block's energy ``L_J = log2 sum_r 2^s_rJ`` (the same quantity the
  fused pass :mod:`.scoring` stores for its max threshold), computed as
  ``M + log2 sum_r 2^(m_r - M) 2^(s_rJ - m_r)`` with ``M = max_r m_r``: a row more
  than 126 below ``M`` drops out, which moves no block across a threshold
  ``alpha >= 2^-126`` (its share of the tile's peak energy is below ``2^-126``);
* with ``accumulate``, the eligible blocks' pooled terms of every row:
  ``l_r = sum_J |B_J| 2^(s_rJ - m_r)`` and ``o_r = sum_J |B_J| 2^(s_rJ - m_r) mean(V_J)``
  (one ``tl.dot`` of the probabilities with the pooled values per step), written
  as the normalised ``o_r / l_r`` and ``lse_r = m_r + log2 l_r`` (``-inf`` for rows
  with no eligible block).

Not yet in the pipeline: the selection (pass 2), subtracting the kept blocks'
terms from these sums, and the merge into the attention kernel's softmax are the
next steps (``benchmarks/NOTES.md``). ``benchmarks/corrected_scoring_speed.py``
measures this pass against the fused pass and the Hopper scoring kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fpv2.kernel.contracts import num_query_tiles
from fpv2.kernel.triton.relaunch import interpreter_enabled

#: Packed query rows per tile (PackGQA: row ``r`` is position ``r // g`` of query head ``h * g + r % g``).
TILE_ROWS = 128


@dataclass(frozen=True)
class CorrectedScores:
    """What :func:`score_with_correction` returns.

    Attributes:
        energies: ``(B, Hkv, tiles, blocks) float32`` log2 block energies ``L_J`` of every scored block of every
            tile (``tiles`` and ``blocks``: the batch's largest counts); entries past a tile's scored blocks are
            ``-inf``; None without ``energies``.
        out: ``(total_q, Hq, d)`` in the pooled values' dtype: the eligible pooled terms' softmax average per
            query row (zeros where a row has no eligible block); None without ``accumulate``.
        lse: ``(total_q, Hq) float32``: ``log2`` of the row's pooled terms' total weight in log2 logit units
            (``-inf`` where a row has no eligible block); None without ``accumulate``.
    """

    energies: torch.Tensor | None
    out: torch.Tensor | None
    lse: torch.Tensor | None


@triton.jit
def _load_rows(base, ids, stride, rows_ok, head_dim, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """Rows ``ids`` of a ``(blocks, d)`` operand (rows not ``rows_ok`` read as 0 when ``MASKED``).

    With ``d = BLOCK_D`` there is no feature mask: a per-element mask on the contiguous axis stops Triton from
    vectorising the load, and unvectorised 2-byte loads are not pipelined through ``cp.async``.
    """
    dims = tl.arange(0, BLOCK_D)
    ptrs = base + ids.to(tl.int64)[:, None] * stride + dims[None, :]
    if EVEN_D:
        if MASKED:
            rows = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            rows = tl.load(ptrs)
    else:
        rows = tl.load(ptrs, mask=rows_ok[:, None] & (dims < head_dim)[None, :], other=0.0)
    return rows


@triton.jit
def _step(
    q,
    keys_base,
    values_base,
    lengths_base,
    energies_row,
    positions,
    start,
    num_scored,
    num_eligible,
    m_i,
    l_i,
    acc,
    stride_k_block,
    stride_v_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    ENERGIES: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One step of ``BLOCK_N`` pooled keys: logits, the blocks' energies, the eligible blocks' pooled terms.

    ``MASKED``: rows see blocks up to their own position (the tile's last steps); otherwise every row sees every
    block of the step, and every block of the step is scored. Returns the updated running row maxima, weights and
    weighted value sums.
    """
    ids = start + tl.arange(0, BLOCK_N)
    scored = ids < num_scored
    kb = _load_rows(keys_base, ids, stride_k_block, scored, head_dim, BLOCK_D, MASKED, EVEN_D)
    if IEEE:  # fp32 operands: IEEE products, not TF32 (tests against float64)
        s = tl.dot(q, tl.trans(kb), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kb))
    if MASKED:
        visible = (ids[None, :] * BLOCK_SIZE <= positions[:, None]) & scored[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    if ENERGIES:
        peak = tl.max(m_new, axis=0)
        weight = tl.where(m_new == float("-inf"), 0.0, tl.exp2(m_safe - peak))
        energy = peak + tl.log2(tl.sum(p * weight[:, None], axis=0))
        tl.store(energies_row + ids, energy, mask=scored)
    if ACCUMULATE:
        # Blocks past the eligible range weigh 0 (an unmasked step reads them: they are scored, so in bounds).
        eligible = ids < num_eligible
        lengths = tl.load(lengths_base + ids, mask=eligible, other=0).to(tl.float32)
        p = p * lengths[None, :]
        rescale = tl.exp2(m_i - m_safe)
        l_i = l_i * rescale + tl.sum(p, axis=1)
        vb = _load_rows(values_base, ids, stride_v_block, eligible, head_dim, BLOCK_D, MASKED, EVEN_D)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(p.to(vb.dtype), vb)
    return m_new, l_i, acc


@triton.jit
def _walk(
    step_args,
    begin,
    end,
    num_scored,
    num_eligible,
    m_i,
    l_i,
    acc,
    stride_k_block,
    stride_v_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    ENERGIES: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    IEEE: tl.constexpr,
    USE_WHILE: tl.constexpr,
):
    """The steps ``begin, begin + BLOCK_N, .. < end`` (:func:`_step`): a ``range()`` loop on GPUs, which Triton
    pipelines, and a ``while`` loop under the interpreter, which cannot take a loaded value as a ``range()``
    bound."""
    q, keys_base, values_base, lengths_base, energies_row, positions = step_args
    if USE_WHILE:
        start = begin
        while start < end:
            m_i, l_i, acc = _step(
                q, keys_base, values_base, lengths_base, energies_row, positions, start, num_scored, num_eligible,
                m_i, l_i, acc, stride_k_block, stride_v_block, head_dim,
                BLOCK_SIZE, BLOCK_N, BLOCK_D, MASKED, EVEN_D, ENERGIES, ACCUMULATE, IEEE,
            )  # fmt: skip
            start += BLOCK_N
    else:
        for start in range(begin, end, BLOCK_N):
            m_i, l_i, acc = _step(
                q, keys_base, values_base, lengths_base, energies_row, positions, start, num_scored, num_eligible,
                m_i, l_i, acc, stride_k_block, stride_v_block, head_dim,
                BLOCK_SIZE, BLOCK_N, BLOCK_D, MASKED, EVEN_D, ENERGIES, ACCUMULATE, IEEE,
            )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _corrected_scoring_kernel(
    q_ptr,
    keys_ptr,
    values_ptr,
    lengths_ptr,
    cu_seqlens_q_ptr,
    seqlens_k_ptr,
    block_offsets_ptr,
    energies_ptr,
    out_ptr,
    lse_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_head,
    stride_v_block,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_lse_tok,
    stride_e_req,
    stride_e_head,
    stride_e_tile,
    group,
    head_dim,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ENERGIES: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    USE_WHILE: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    req = tl.program_id(2)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    kv_len = tl.load(seqlens_k_ptr + req)
    prefix = kv_len - q_len
    num_rows = q_len * group
    tile = (num_rows + TILE - 1) // TILE - 1 - tl.program_id(0)  # the last (heaviest) tiles launch first
    if tile < 0:
        return
    rows = tile * TILE + tl.arange(0, TILE)
    row_ok = rows < num_rows
    positions = tl.where(row_ok, prefix + rows // group, -1)
    first = prefix + (tile * TILE) // group
    last = prefix + (tl.minimum(tile * TILE + TILE, num_rows) - 1) // group
    num_scored = (last + 1) // BLOCK_SIZE
    num_eligible = first // BLOCK_SIZE  # the correction plan's eligible range
    # Steps in which every row sees every block (J * Bk <= first): no per-logit mask. A short tile has padding rows.
    full_tile = tile * TILE + TILE <= num_rows
    num_unmasked = tl.where(full_tile, tl.minimum(first // BLOCK_SIZE + 1, num_scored) // BLOCK_N * BLOCK_N, 0)

    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    tokens = (q_start + rows // group).to(tl.int64)
    q_heads = head * group + rows % group
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_tok + q_heads[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(keys_ptr.dtype.element_ty)

    block_base = tl.load(block_offsets_ptr + req).to(tl.int64)
    keys_base = keys_ptr + block_base * stride_k_block + head * stride_k_head
    values_base = values_ptr + block_base * stride_v_block + head * stride_v_head
    energies_row = energies_ptr + req * stride_e_req + head * stride_e_head + tile.to(tl.int64) * stride_e_tile
    m_i = tl.full((TILE,), float("-inf"), tl.float32)
    l_i = tl.zeros((TILE,), tl.float32)
    acc = tl.zeros((TILE, BLOCK_D), tl.float32)
    step_args = (q, keys_base, values_base, lengths_ptr + block_base, energies_row, positions)
    m_i, l_i, acc = _walk(
        step_args, 0, num_unmasked, num_scored, num_eligible, m_i, l_i, acc, stride_k_block, stride_v_block,
        head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, EVEN_D, ENERGIES, ACCUMULATE, IEEE, USE_WHILE,
    )  # fmt: skip
    m_i, l_i, acc = _walk(
        step_args, num_unmasked, num_scored, num_scored, num_eligible, m_i, l_i, acc, stride_k_block, stride_v_block,
        head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, EVEN_D, ENERGIES, ACCUMULATE, IEEE, USE_WHILE,
    )  # fmt: skip
    if ACCUMULATE:
        has_terms = l_i > 0
        out = acc / tl.where(has_terms, l_i, 1.0)[:, None]
        lse = tl.where(has_terms, m_i + tl.log2(tl.where(has_terms, l_i, 1.0)), float("-inf"))
        tl.store(
            out_ptr + tokens[:, None] * stride_o_tok + q_heads[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(lse_ptr + tokens * stride_lse_tok + q_heads, lse, mask=row_ok)


def _check(name: str, tensor: object, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    return tensor


def score_with_correction(
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_lengths: torch.Tensor,
    block_offsets: torch.Tensor,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_size: int = 128,
    accumulate: bool = True,
    energies: bool = True,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
) -> CorrectedScores:
    """Pass 1 of scoring with the mean correction's pooled terms (see the module docstring).

    Args:
        q: ``(total_q, Hq, d)`` queries (fp16, bf16 or fp32), ``d`` contiguous.
        cu_seqlens_q: ``(B+1,) int32`` query offsets; request ``b`` has ``seqlens_k[b] - q_len`` cached tokens.
        seqlens_k: ``(B,) int32`` keys per request (prefix + new tokens).
        keys: ``(total_blocks, Hkv, d)`` pooled keys in log2 logit units (``mean(K_J) * scale * log2 e``), in the
            dot dtype the queries are cast to (the pooling kernel's prepared copy).
        values: ``(total_blocks, Hkv, d)`` pooled values, in the dtype of the probabilities' dot (bf16 copies on
            GPUs; fp32 under the interpreter, whose bf16 dot is broken).
        block_lengths: ``(total_blocks,) int32`` valid tokens per block.
        block_offsets: ``(B+1,) int32`` cumulative blocks per request.
        max_seqlen_q: the batch's longest query (sizes the grid and the energies).
        max_seqlen_k: the batch's longest key sequence (sizes the energies).
        block_size: tokens per key block.
        accumulate: accumulate the correction's pooled terms (off: energies only, the same orientation).
        energies: compute and store the block energies (off: the pooled terms only, a plain online softmax over
            the eligible pooled keys, to measure what the energies cost).
        block_n: pooled keys per step.
        num_warps: warps per program.
        num_stages: software-pipeline depth of the pooled-key loads.

    Returns:
        :class:`CorrectedScores`.
    """
    _check("q", q, (torch.float16, torch.bfloat16, torch.float32), 3)
    _check("keys", keys, (torch.float16, torch.bfloat16, torch.float32), 3)
    _check("values", values, (torch.float16, torch.bfloat16, torch.float32), 3)
    _check("cu_seqlens_q", cu_seqlens_q, (torch.int32,), 1)
    _check("seqlens_k", seqlens_k, (torch.int32,), 1)
    _check("block_lengths", block_lengths, (torch.int32,), 1)
    _check("block_offsets", block_offsets, (torch.int32,), 1)
    total_q, num_q_heads, head_dim = q.shape
    batch = seqlens_k.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1 or block_offsets.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and block_offsets {tuple(block_offsets.shape)} must have "
            f"B+1 = {batch + 1} entries (seqlens_k has B = {batch})"
        )
    if keys.shape[2] != head_dim or values.shape != keys.shape:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must both be (total_blocks, Hkv, d={head_dim})"
        )
    num_kv_heads = keys.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q has Hq={num_q_heads} heads, not a multiple of the keys' Hkv={num_kv_heads}")
    if block_lengths.shape[0] != keys.shape[0]:
        raise ValueError(f"block_lengths has {block_lengths.shape[0]} entries, keys {keys.shape[0]} blocks")
    for name, t in (("q", q), ("keys", keys), ("values", values)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    group = num_q_heads // num_kv_heads
    tiles = num_query_tiles(max_seqlen_q, group, TILE_ROWS)
    blocks = -(-max_seqlen_k // block_size)
    if not (energies or accumulate):
        raise ValueError("energies=False and accumulate=False leave the pass nothing to compute")
    energies_out = None
    if energies:
        energies_out = torch.full(
            (batch, num_kv_heads, tiles, blocks), float("-inf"), dtype=torch.float32, device=q.device
        )
    out = lse = None
    if accumulate:
        out = torch.zeros((total_q, num_q_heads, head_dim), dtype=values.dtype, device=q.device)
        lse = torch.full((total_q, num_q_heads), float("-inf"), dtype=torch.float32, device=q.device)
    # Absent outputs: any tensor of the call stands in for the pointer (the kernel never touches it).
    e_arg = energies_out if energies_out is not None else lse
    out_arg = out if out is not None else e_arg
    lse_arg = lse if lse is not None else e_arg
    e_strides = energies_out.stride()[:3] if energies_out is not None else (0, 0, 0)
    _corrected_scoring_kernel[(tiles, num_kv_heads, batch)](
        q, keys, values, block_lengths, cu_seqlens_q, seqlens_k, block_offsets, e_arg, out_arg, lse_arg,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        out.stride(0) if out is not None else 0, out.stride(1) if out is not None else 0,
        lse.stride(0) if lse is not None else 0,
        *e_strides,
        group, head_dim,
        TILE=TILE_ROWS, BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        ENERGIES=energies, ACCUMULATE=accumulate, USE_WHILE=interpreter_enabled(),
        IEEE=keys.dtype == values.dtype == torch.float32, EVEN_D=head_dim == triton.next_power_of_2(head_dim),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return CorrectedScores(energies=energies_out, out=out, lse=lse)
