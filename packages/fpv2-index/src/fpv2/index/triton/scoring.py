"""Fused single-pass scoring and max-threshold selection, one segment at a time.

A persistent grid of ``P`` programs walks the (request, KV head, query tile)
segments, heaviest tiles (the last ones of the batch) first. For its segment a
program:

1. loads the tile's packed query rows once (PackGQA: row ``r`` is position
   ``r // g`` of query head ``h * g + r % g``; with ``probe_stride = s`` only
   rows ``0, s, 2s, ...`` of the tile);
2. walks the scored pooled keys ``J < num_scored`` once, in chunks of
   :data:`~.workspace.CHUNK_BLOCKS`: logits ``s_rJ`` in log2 units with the
   scale (and the FP8 query descale) folded in, row ``r`` contributing to
   ``J`` only when ``J * Bk <= prefix + p_r``; for every block of the chunk
   its log2 energy ``L_J = log2(sum_r 2^s_rJ)`` goes to the program's
   workspace row, and a running maximum ``L_max`` is kept;
3. walks the visible blocks once more, reading ``L_J`` back: keeps ``J`` when
   ``2^(L_J - L_max) >= alpha``, i.e. the reference's ``E_J >= alpha * max E``,
   or when it is forced (sink, window, diagonal band) or the tile is dense;
   writes the keep bits (one bit per block, two int32 words per chunk) and the
   segment's count.

Relation to the reference's online pass (one running tile maximum ``M`` and
``E_J = sum_r 2^(s_rJ - M)``, earlier chunks rescaled when ``M`` grows): the
selection rule only uses ratios ``E_J / max E``, in which any common factor
``2^-M`` cancels. A block's energy is complete once its chunk is scored (every
row of the tile meets it there), so instead of rescaling earlier chunks the
kernel stores each energy in log2 units, ``L_J = log2 E_J + M``, computed
against the block's own row maximum: the same numbers without underflow, and
with the maxima and sums of a chunk reduced within warps (logits are laid out
(block, row)), so the loop body has no cross-warp reduction. The only state
is ``L_max`` and one row of ``Nb`` floats per program: no logit matrix, no
sort, no ``L x L/B`` buffer. Results differ from the reference only by
rounding (and for ``alpha`` below ``2^-126``, where the reference's energies
underflow).

Dot precision: fp16 and fp32 queries score with their own dtype (fp32 in
IEEE mode); bf16 queries score in bf16 on GPUs and in fp32 under the Triton
interpreter (whose bf16 ``tl.dot`` is broken); FP8 queries are upcast to fp16
(exact for e4m3). Pooled keys (fp32, real units) are cast to the dot dtype
once per call, before the kernel.

On GPUs the pass-1 loop is a ``range()`` loop so Triton pipelines the
pooled-key loads; under the interpreter it is a ``while`` loop, because the
Triton 3.6 interpreter cannot take a loaded value as a ``range()`` bound.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .workspace import CHUNK_BLOCKS, WORD_BITS, WorkspaceViews

#: ``log2(e)``: logits are scored in log2 units so energies are powers of two.
LOG2E = math.log2(math.e)

#: Dot operand kinds (constexpr ``DOT_KIND``).
DOT_FP32, DOT_FP16, DOT_BF16 = 0, 1, 2
_DOT_DTYPES = {DOT_FP32: torch.float32, DOT_FP16: torch.float16, DOT_BF16: torch.bfloat16}

#: Launch knobs of the fused kernel on GPUs. Measured on an H200 (one 128K request, 32/8 heads, d 128,
#: bf16, 2 programs per SM): 4 warps 3.3 ms, 8 warps 5.0 ms; 3 stages or 4-8 programs per SM change < 3%.
SCORE_NUM_WARPS = 4
SCORE_NUM_STAGES = 2


@triton.jit
def _score_chunk(
    q_t,
    keys_row,
    energies_row,
    c0,
    num_candidates,
    positions,
    scale,
    energy_max,
    stride_pk_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_KIND: tl.constexpr,
):
    """One chunk of pass 1: log2 energies of pooled keys ``c0 .. c0 + BLOCK_N - 1`` and the running maxima.

    Logits are laid out (block, row), so the per-block maximum and sum over rows
    are reductions within a warp: the loop body has no cross-warp reduction.
    """
    ids = c0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    id_ok = ids < num_candidates
    kbar = tl.load(
        keys_row + ids.to(tl.int64)[:, None] * stride_pk_block + dims[None, :],
        mask=id_ok[:, None] & (dims < head_dim)[None, :],
        other=0.0,
    )
    if DOT_KIND == 0:
        logits = tl.dot(kbar, q_t, input_precision="ieee")
    else:
        logits = tl.dot(kbar, q_t)
    contributes = id_ok[:, None] & (ids[:, None] * BLOCK_SIZE <= positions[None, :])
    logits = tl.where(contributes, logits * scale, float("-inf"))
    block_max = tl.max(logits, axis=1)
    offset = tl.where(block_max == float("-inf"), 0.0, block_max)
    # log2(sum_r 2^s_rJ), offset by the block's own maximum so nothing underflows; -inf when no row contributes.
    energy = offset + tl.log2(tl.sum(tl.exp2(logits - offset[:, None]), axis=1))
    tl.store(energies_row + ids, energy, mask=id_ok)
    return tl.maximum(energy_max, tl.where(id_ok, energy, float("-inf")))


@triton.jit
def _score_select_kernel(
    q_ptr,
    pooled_k_ptr,
    q_descale_ptr,
    cu_seqlens_q_ptr,
    seqlens_k_ptr,
    tile_offsets_ptr,
    tile_request_ptr,
    block_offsets_ptr,
    energies_ptr,
    keep_bits_ptr,
    counts_ptr,
    stride_q_tok,
    stride_q_head,
    stride_pk_block,
    stride_pk_head,
    num_work,
    num_kv_heads,
    group,
    head_dim,
    energies_stride,
    bits_stride,
    scale_log2,
    alpha,
    sink_blocks,
    window_tokens,
    dense_tail_tiles,
    min_sparse_kv_len,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PROBE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WORD: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    USE_WHILE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    total_tiles = num_work // num_kv_heads
    energies_row = energies_ptr + pid.to(tl.int64) * energies_stride
    rows_i = tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    chunk = tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, WORD)

    # while loops, not range(): the Triton 3.6 interpreter cannot use loaded values as range() bounds.
    work = pid
    while work < num_work:
        # ---- which segment: the last tiles of the batch (the longest rows) first
        tile_global = total_tiles - 1 - work // num_kv_heads
        head = work % num_kv_heads
        b = tl.load(tile_request_ptr + tile_global)
        tile_begin = tl.load(tile_offsets_ptr + b)
        num_tiles = tl.load(tile_offsets_ptr + b + 1) - tile_begin
        tile = tile_global - tile_begin
        q_start = tl.load(cu_seqlens_q_ptr + b)
        q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
        kv_len = tl.load(seqlens_k_ptr + b)
        prefix = kv_len - q_len
        segment = num_kv_heads * tile_begin + head * num_tiles + tile

        # ---- tile geometry (all quantities non-negative: integer division is floor division)
        row_begin = tile * TILE
        row_end = tl.minimum(row_begin + TILE, q_len * group)
        first = prefix + row_begin // group
        last = prefix + (row_end - 1) // group
        num_visible = last // BLOCK_SIZE + 1
        num_scored = (last + 1) // BLOCK_SIZE
        first_diagonal = first // BLOCK_SIZE
        dense = (tile >= num_tiles - dense_tail_tiles) | (kv_len < min_sparse_kv_len)
        num_candidates = tl.where(dense, 0, num_scored)
        has_window = (window_tokens > 0) & (first > 0)
        window_lo = tl.maximum(first - window_tokens, 0) // BLOCK_SIZE
        window_hi = tl.where(has_window, tl.maximum(first - 1, 0) // BLOCK_SIZE, -1)
        block_base = tl.load(block_offsets_ptr + b)

        # ---- the tile's (probed) packed rows
        in_tile = rows_i * PROBE
        rows = row_begin + in_tile
        row_ok = (in_tile < TILE) & (rows < row_end)
        positions = tl.where(row_ok, prefix + rows // group, -1)
        tokens = (q_start + rows // group).to(tl.int64)
        q_heads = head * group + rows % group
        q_addr = tokens[:, None] * stride_q_tok + q_heads[:, None] * stride_q_head + dims[None, :]
        q = tl.load(q_ptr + q_addr, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        q = q.to(pooled_k_ptr.dtype.element_ty)  # the dot dtype (keys come cast to it)
        scale = scale_log2
        if HAS_Q_DESCALE:
            scale = scale_log2 * tl.load(q_descale_ptr + b * num_kv_heads + head)

        # ---- pass 1: one walk over the candidate pooled keys; log2 energies to the workspace row
        q_t = tl.trans(q)
        keys_row = pooled_k_ptr + block_base.to(tl.int64) * stride_pk_block + head * stride_pk_head
        energy_max = tl.full([BLOCK_N], float("-inf"), tl.float32)  # per lane; reduced once after the walk
        if USE_WHILE:  # the interpreter cannot take loaded values as range() bounds
            c0 = num_candidates * 0
            while c0 < num_candidates:
                energy_max = _score_chunk(
                    q_t,
                    keys_row,
                    energies_row,
                    c0,
                    num_candidates,
                    positions,
                    scale,
                    energy_max,
                    stride_pk_block,
                    head_dim,
                    BLOCK_SIZE,
                    BLOCK_N,
                    BLOCK_D,
                    DOT_KIND,
                )
                c0 += BLOCK_N
        else:  # a range() loop, so Triton pipelines the pooled-key loads
            for c0 in range(0, num_candidates, BLOCK_N):
                energy_max = _score_chunk(
                    q_t,
                    keys_row,
                    energies_row,
                    c0,
                    num_candidates,
                    positions,
                    scale,
                    energy_max,
                    stride_pk_block,
                    head_dim,
                    BLOCK_SIZE,
                    BLOCK_N,
                    BLOCK_D,
                    DOT_KIND,
                )
        peak_log2 = tl.max(energy_max, axis=0)  # log2 of max_J E_J; -inf when nothing was scored
        # Pass 2 reads energies other threads of this program wrote.
        tl.debug_barrier()

        # ---- pass 2: threshold, forced blocks, dense fallback -> keep bits and count
        # E_J >= alpha * max E  <=>  2^(log2 E_J - log2 max E) >= alpha; never when nothing was scored (the
        # reference's ``peak > 0``). A scalar where, not a scalar-bool broadcast, which the interpreter mistypes.
        threshold = tl.where(peak_log2 == float("-inf"), float("inf"), alpha)
        peak_offset = tl.where(peak_log2 == float("-inf"), 0.0, peak_log2)
        count = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int32), axis=0)
        bits_row = keep_bits_ptr + segment.to(tl.int64) * bits_stride
        c0 = num_visible * 0
        while c0 < num_visible:
            ids = c0 + chunk
            scored = ids < num_candidates
            energy = tl.load(energies_row + ids, mask=scored, other=float("-inf"))
            keep = scored & (tl.exp2(energy - peak_offset) >= threshold)
            forced = (ids < sink_blocks) | ((ids >= window_lo) & (ids <= window_hi)) | (ids >= first_diagonal)
            keep = (keep | forced | dense) & (ids < num_visible)
            keep_i = keep.to(tl.int32)
            words = tl.sum(tl.reshape(keep_i, (BLOCK_N // WORD, WORD)) << lanes[None, :], axis=1)
            tl.store(bits_row + c0 // WORD + tl.arange(0, BLOCK_N // WORD), words)
            count += tl.sum(keep_i, axis=0)
            c0 += BLOCK_N
        tl.store(counts_ptr + segment, count)
        # The next segment overwrites this program's energies row.
        tl.debug_barrier()
        work += num_programs


def launch_score_select(
    q: torch.Tensor,
    pooled_k: torch.Tensor,
    *,
    q_descale: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    tile_offsets: torch.Tensor,
    tile_request: torch.Tensor,
    block_offsets: torch.Tensor,
    views: WorkspaceViews,
    num_work: int,
    num_programs: int,
    group: int,
    scale: float,
    alpha: float,
    tile_size: int,
    block_size: int,
    probe_stride: int,
    sink_tokens: int,
    window_tokens: int,
    dense_tail_tiles: int,
    min_sparse_kv_len: int,
    dot_kind: int,
    interpret: bool,
) -> None:
    """Run the fused scoring/selection kernel (inputs checked by the caller).

    Writes ``views.keep_bits`` (the rows of every segment, whole chunks up to the
    tile's visible blocks) and ``views.counts``.

    Args:
        q: ``(total_q, Hq, d)`` queries, unit stride in ``d``.
        pooled_k: ``(total_blocks, Hkv, d) float32`` contiguous pooled keys.
        q_descale: ``(B, Hkv) float32`` contiguous, or None.
        cu_seqlens_q: ``(B+1,) int32`` query offsets.
        seqlens_k: ``(B,) int32`` KV lengths.
        tile_offsets: ``(B+1,) int32`` cumulative tiles per request.
        tile_request: ``(total_tiles,)`` request of each global tile.
        block_offsets: ``(B+1,) int32`` cumulative key blocks per request.
        views: workspace views of the call.
        num_work: segments ``Hkv * total_tiles``.
        num_programs: persistent grid size.
        group: GQA group size ``g``.
        scale: logit scale in natural-log units (before the query descale).
        alpha: threshold ratio.
        tile_size: packed rows per tile.
        block_size: tokens per key block.
        probe_stride: score every ``probe_stride``-th row of a tile.
        sink_tokens: leading tokens always kept.
        window_tokens: tokens before the tile always kept.
        dense_tail_tiles: last tiles of a request kept dense.
        min_sparse_kv_len: requests shorter than this are kept dense.
        dot_kind: :data:`DOT_FP32`, :data:`DOT_FP16` or :data:`DOT_BF16`.
        interpret: running under the Triton interpreter (pass-1 loop as ``while``).
    """
    if num_work == 0:
        return
    num_kv_heads, head_dim = pooled_k.shape[1], pooled_k.shape[2]
    rows = max(16, triton.next_power_of_2(-(-tile_size // probe_stride)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Keys cast once to the dot dtype (half the bytes per chunk, no per-chunk conversion); a tiny tensor.
    keys = pooled_k.to(_DOT_DTYPES[dot_kind]).contiguous()
    _score_select_kernel[(num_programs,)](
        q,
        keys,
        q_descale if q_descale is not None else pooled_k,
        cu_seqlens_q,
        seqlens_k,
        tile_offsets,
        tile_request,
        block_offsets,
        views.energies,
        views.keep_bits,
        views.counts,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        num_work,
        num_kv_heads,
        group,
        head_dim,
        views.energies.stride(0),
        views.keep_bits.stride(0),
        scale * LOG2E,
        float(alpha),
        -(-sink_tokens // block_size),
        window_tokens,
        dense_tail_tiles,
        min_sparse_kv_len,
        TILE=tile_size,
        BLOCK_SIZE=block_size,
        PROBE=probe_stride,
        ROWS=rows,
        BLOCK_N=CHUNK_BLOCKS,
        BLOCK_D=block_d,
        WORD=WORD_BITS,
        DOT_KIND=dot_kind,
        HAS_Q_DESCALE=q_descale is not None,
        USE_WHILE=interpret,
        num_warps=SCORE_NUM_WARPS,
        num_stages=SCORE_NUM_STAGES,
    )
