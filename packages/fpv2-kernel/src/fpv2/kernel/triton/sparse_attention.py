"""The portable block-sparse prefill attention kernel, written in Triton.

One program handles one segment (request ``b``, KV head ``h``, query tile ``t``)
of the block index: the tile's ``BLOCK_M`` PackGQA rows (packed row ``r`` is
query position ``r // g`` of query head ``h * g + r % g``) attend to the kept key
blocks of the segment, read straight out of the paged KV cache through the
page table. The program runs three phases over one online-softmax state:

1. kept blocks wholly visible to every row of the tile, without any mask
   (the bulk of the work, software-pipelined);
2. kept blocks of the diagonal band (at most ``BAND`` of them), with the
   bottom-right causal mask and the KV tail mask;
3. with a correction plan, the pruned eligible blocks in chunks of ``CHUNK``
   pooled vectors: one extra QK/softmax/PV step per chunk whose todo word is
   not zero, each todo column weighted by its block length (``+ log2 |B_J|``)
   and, with ``SECOND_ORDER``, by the second-order mass shift of its block
   (``min(a_r var_J, b_r rad_J)``: two per-row and two per-column scalars).

Logits are kept in log2 units: the softmax scale is multiplied by ``log2(e)``
on the host and every exponential is an ``exp2``. FP8 probabilities are
computed as ``2^(s - m + 8)`` so they fill e4m3's range; the shift cancels in
the normalisation and is removed from the log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: ``DOT_KIND`` values: how operands reach ``tl.dot`` and how P is rounded.
#: Native: fp16/bf16 operands, or e4m3 operands on GPUs with fp8 tensor cores (sm89+).
DOT_NATIVE = 0
#: fp32 operands, IEEE products (fp32 inputs).
DOT_FP32 = 1
#: e4m3 operands widened to fp16 (exact) on GPUs without fp8 dots; P still rounded to e4m3.
DOT_FP16 = 2
#: Triton interpreter, bf16 inputs: its bf16 dot is broken and its fp32->bf16 cast truncates,
#: so operands are widened to fp32 and P is rounded to the bf16 grid (nearest-even) in fp32.
DOT_INTERP_BF16 = 3
#: Triton interpreter, e4m3 inputs: its fp32->e4m3 cast misrounds (7.9 -> 4), so P is rounded
#: to the e4m3 grid (nearest-even, saturating at 448) in fp32 and the products run in fp32.
DOT_INTERP_FP8 = 4


@triton.jit
def _round_nearest_even(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """``x`` (finite, >= 0) rounded to a float grid with ``MANTISSA_BITS`` explicit bits, in fp32.

    Values below ``2^MIN_EXPONENT`` share that binade's spacing (subnormals). Adding
    and removing ``2^23`` rounds ``x / ulp < 2^24`` to an integer, nearest-even.
    """
    exponent = tl.floor(tl.log2(tl.maximum(x, 2.0**MIN_EXPONENT)))
    ulp = tl.exp2(exponent - MANTISSA_BITS)
    return ((x / ulp + 8388608.0) - 8388608.0) * ulp


@triton.jit
def _attend_subtile(
    q,
    q_abs,
    m_i,
    l_i,
    acc,
    qk_scale,
    k_head,
    v_head,
    pt_row,
    kstart,
    kv_len,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    P_SHIFT: tl.constexpr,
    DOT_KIND: tl.constexpr,
):
    """One online-softmax step of the tile's rows over the ``BLOCK_N`` keys starting at ``kstart``.

    Keys and values are gathered through the page table: token ``pos`` lives at
    ``(page_table[b, pos // PAGE_SIZE], pos % PAGE_SIZE)``. When a page holds a whole
    sub-tile the page id is one scalar load; otherwise (page size 1, 16, ...) every row
    looks up its own page. ``MASKED`` sub-tiles (the diagonal band) get the causal mask
    and may run past the request's KV: those rows are never read. Logits are in log2
    units; ``DOT_KIND`` says how operands reach ``tl.dot``. (Loads and products are
    written out in one helper: every nested call costs the interpreter milliseconds.)
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kpos = kstart + offs_n
    in_kv = kpos < kv_len
    if PAGE_SIZE % BLOCK_N == 0:
        # kstart is a multiple of BLOCK_N, so the sub-tile sits in one page (whose first
        # token kstart is real: masked sub-tiles are only visited when kstart < kv_len).
        page = tl.load(pt_row + kstart // PAGE_SIZE).to(tl.int64)
        slot = kstart % PAGE_SIZE + offs_n
    else:
        if MASKED:
            page = tl.load(pt_row + kpos // PAGE_SIZE, mask=in_kv, other=0).to(tl.int64)
        else:
            page = tl.load(pt_row + kpos // PAGE_SIZE).to(tl.int64)
        slot = kpos % PAGE_SIZE
    k_ptrs = k_head + (page * stride_kp + slot * stride_ks)[:, None] + offs_d[None, :]
    v_ptrs = v_head + (page * stride_vp + slot * stride_vs)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=in_kv[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=in_kv[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)

    if DOT_KIND == 0:
        s = tl.dot(q, tl.trans(k))
    elif DOT_KIND == 2:
        s = tl.dot(q.to(tl.float16), tl.trans(k.to(tl.float16)))
    else:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    # The scale (> 0) is applied inside the exponent, ``2^(s * scale - m)``: one FMA per
    # logit; the running maximum is kept in scaled units.
    if MASKED:
        # Bottom-right causal: the row at absolute position q_abs sees keys 0 .. q_abs. Keys
        # past the KV tail are past every real row's position, so this masks them too.
        s = tl.where(kpos[None, :] <= q_abs[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        # A row may not see any key yet: shift by 0 instead of -inf to avoid inf - inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - (m_use - P_SHIFT)[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to V's dtype (e4m3 for FP8, after the 2^8 shift) before the PV product,
    # which accumulates into the rescaled accumulator in place.
    acc = acc * alpha[:, None]
    if DOT_KIND == 0:
        acc = tl.dot(p.to(v.dtype), v, acc)
    elif DOT_KIND == 2:
        acc = tl.dot(p.to(v.dtype).to(tl.float16), v.to(tl.float16), acc)
    else:
        if DOT_KIND == 3:
            p = _round_nearest_even(p, 7, -100)
        elif DOT_KIND == 4:
            p = tl.minimum(_round_nearest_even(p, 3, -6), 448.0)
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _correct_chunk(
    q_c,
    pooled_k_head,
    pooled_v_head,
    stat,
    stride_pb,
    block_lengths,
    eligible,
    todo,
    m_i,
    l_i,
    acc,
    corr_scale,
    v_units,
    shift_a,
    shift_b,
    variance_head,
    radius_head,
    stride_sb,
    HEAD_DIM: tl.constexpr,
    P_SHIFT: tl.constexpr,
    CORR_KIND: tl.constexpr,
    FP8: tl.constexpr,
    SECOND_ORDER: tl.constexpr,
):
    """One online-softmax step over a chunk of pooled blocks (statistics rows ``stat``).

    Column ``J`` stands for the ``|B_J|`` pruned tokens of its block: logit
    ``q . kbar_J * scale + log2 |B_J|`` (log2 units; applied as the weight ``|B_J|`` on the
    column's probabilities) and value ``vbar_J * v_units``; columns that are not todo get
    ``-inf``. Loads depend on ``eligible`` only (a function of the step number), not on the
    todo bits, so the loop software-pipelines.
    With ``SECOND_ORDER`` the logit also gains ``min(shift_a_r * var_J, shift_b_r * rad_J)``
    (log2 units; the row factors come from ``|q_r|``, see the kernel's phase 3).

    With ``CORR_KIND`` 0 the pooled vectors and ``q_c`` are fp32 and the products IEEE
    fp32; otherwise both are 16-bit (fp16 or bf16, converted once by the launcher) and
    the products run on the tensor cores with fp32 accumulation.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    offs = stat[:, None] * stride_pb + offs_d[None, :]
    kbar = tl.load(pooled_k_head + offs, mask=eligible[:, None], other=0.0)
    if CORR_KIND == 0:
        s = tl.dot(q_c, tl.trans(kbar), input_precision="ieee")
    else:
        s = tl.dot(q_c, tl.trans(kbar))
    # |B_J| weighs the column's probabilities, 2^(s + log2 |B_J|) = |B_J| 2^s: one product a column where an
    # additive bias needed an accurate log2 (libdevice, ~30 instructions and a branch a column, on the step's
    # critical path: the corrected kernel 10% slower at 128K). The row maximum is taken without log2 |B_J|, so
    # probabilities reach |B_J| <= block size: exact in fp32 and in the bf16 / fp16 operands of the PV product.
    weight = tl.load(block_lengths + stat, mask=eligible, other=0).to(tl.float32)
    s = s * corr_scale + tl.where(todo, 0.0, float("-inf"))[None, :]
    if SECOND_ORDER:
        var = tl.load(variance_head + stat * stride_sb, mask=eligible, other=0.0)
        rad = tl.load(radius_head + stat * stride_sb, mask=eligible, other=0.0)
        s += tl.minimum(shift_a[:, None] * var[None, :], shift_b[:, None] * rad[None, :])
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A chunk may hold no todo column, and a row may have seen no key: no inf - inf.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - (m_use - P_SHIFT)[:, None]) * weight[None, :]
    l_i = l_i * alpha + tl.sum(p, 1)
    vbar = tl.load(pooled_v_head + offs, mask=eligible[:, None], other=0.0)
    if FP8:
        p = p * v_units  # pooled values are in real units, the accumulator in FP8 V units
    acc = acc * alpha[:, None]
    if CORR_KIND == 0:
        acc = tl.dot(p, vbar, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(vbar.dtype), vbar, acc)
    return m_new, l_i, acc


@triton.jit
def _segment(pid, SegRequest, TileOffsets, CuSeqlensQ, SeqlensK, NUM_KV_HEADS: tl.constexpr, VOLATILE: tl.constexpr):
    """Request ``b``, KV head ``h``, tile ``t``, first query, query and KV lengths of program ``pid``.

    The request comes from the launch's table; (KV head, tile) follow from the segment order
    ``s = Hkv * tile_offsets[b] + h * ntiles_b + t``. ``VOLATILE`` reloads the metadata so
    the compiler recomputes the row vectors derived from it instead of keeping the first
    copies alive in registers across the block loops.
    """
    b = tl.load(SegRequest + pid, volatile=VOLATILE)
    tile_start = tl.load(TileOffsets + b, volatile=VOLATILE)
    ntiles = tl.load(TileOffsets + b + 1, volatile=VOLATILE) - tile_start
    local = pid - NUM_KV_HEADS * tile_start
    h = local // ntiles
    t = local - h * ntiles
    q_start = tl.load(CuSeqlensQ + b, volatile=VOLATILE)
    q_len = tl.load(CuSeqlensQ + b + 1, volatile=VOLATILE) - q_start
    kv_len = tl.load(SeqlensK + b, volatile=VOLATILE)
    return b, h, t, q_start, q_len, kv_len


@triton.jit
def sparse_prefill_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    CuSeqlensQ,
    SeqlensK,
    PageTable,
    SegRequest,
    SegOrder,
    TileOffsets,
    IdxOffsets,
    IdxBlocks,
    QDescale,
    KDescale,
    VDescale,
    PooledK,
    PooledV,
    BlockLengths,
    BlockOffsets,
    TodoOffsets,
    TodoMasks,
    KeyVariance,
    KeyRadius,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    stride_pt,
    stride_pb,
    stride_ph,
    stride_sb,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BAND: tl.constexpr,
    CHUNK: tl.constexpr,
    CORR_N: tl.constexpr,
    DENSE: tl.constexpr,
    CORRECTION: tl.constexpr,
    SECOND_ORDER: tl.constexpr,
    FP8: tl.constexpr,
    P_SHIFT: tl.constexpr,
    DOT_KIND: tl.constexpr,
    CORR_KIND: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PIPE_STAGES: tl.constexpr,
    CORR_STAGES: tl.constexpr,
    REVERSE: tl.constexpr,
    ORDERED: tl.constexpr,
):
    """Attention of one (request, KV head, tile) segment over its kept blocks (+ mean correction).

    Pointers: ``Q (total_q, Hq, d)``, ``K``/``V (num_pages, page_size, Hkv, d)``, ``Out`` like Q,
    ``Lse (total_q, Hq) f32``; batch metadata ``CuSeqlensQ (B+1,)``, ``SeqlensK (B,)``,
    ``PageTable (B, max_pages)``; ``SegRequest (S,)`` request of each segment, ``SegOrder (S,)`` the
    segment of each program when ``ORDERED`` (:mod:`.work_order`), and
    ``TileOffsets (B+1,)``; CSR ``IdxOffsets (S+1,)``, ``IdxBlocks (nnz,)`` (unused when
    ``DENSE``); FP8 descales ``(B, Hkv)`` contiguous; correction statistics and todo words
    (unused without ``CORRECTION``); with ``SECOND_ORDER`` the key spread ``KeyVariance`` /
    ``KeyRadius (total_blocks, Hkv) f32`` (row stride ``stride_sb``). All integer metadata is
    int32. ``P_SHIFT`` is 8 for FP8 (probabilities ``2^(s - m + 8)``) and 0 otherwise.
    ``CORR_KIND`` picks the correction's products: 0 fp32 IEEE, 1 split fp16, 2 split bf16
    (see :func:`_correct_chunk`).
    """
    if ORDERED:
        # The kept-block work order: heaviest segments first (work_order.py).
        pid = tl.load(SegOrder + tl.program_id(0))
    elif REVERSE:
        # Segments run last to first: within a request, the tiles late in the sequence (the
        # most blocks to walk) start first and the short ones fill the tail of the grid.
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid = tl.program_id(0)
    b, h, t, q_start, q_len, kv_len = _segment(pid, SegRequest, TileOffsets, CuSeqlensQ, SeqlensK, NUM_KV_HEADS, False)
    prefix = kv_len - q_len

    # ---- PackGQA rows of the tile
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rows = q_len * GROUP
    row_ok = rows < n_rows
    pos = rows // GROUP
    head = h * GROUP + rows % GROUP
    first_abs = prefix + (t * BLOCK_M) // GROUP
    last_abs = prefix + (tl.minimum(t * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    token = (q_start + pos).to(tl.int64)
    q_ptrs = Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    qk_scale = sm_scale_log2
    if FP8:
        q_descale = tl.load(QDescale + b * NUM_KV_HEADS + h)
        qk_scale = sm_scale_log2 * q_descale * tl.load(KDescale + b * NUM_KV_HEADS + h)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N
    pt_row = PageTable + b.to(tl.int64) * stride_pt
    k_head = K + h * stride_kh
    v_head = V + h * stride_vh
    # Blocks below this id are wholly visible to every row of the tile: no mask at all.
    full_limit = (first_abs + 1) // BLOCK_SIZE

    # ---- how many kept blocks need no mask; the rest form the diagonal band
    if DENSE:
        seg_start = 0
        n_total = last_abs // BLOCK_SIZE + 1
        n_full = full_limit
    else:
        seg_start = tl.load(IdxOffsets + pid)
        seg_end = tl.load(IdxOffsets + pid + 1)
        n_total = seg_end - seg_start
        # Kept ids are ascending and at most BAND of them reach the band, so counting
        # among the last BAND ids is enough (the index was checked against the batch).
        tail_idx = seg_end - BAND + tl.arange(0, BAND)
        tail = tl.load(IdxBlocks + tail_idx, mask=tail_idx >= seg_start, other=-1)
        n_full = n_total - tl.sum((tail >= full_limit).to(tl.int32), 0)

    # ---- phase 1: unmasked sub-tiles (software-pipelined)
    for it in tl.range(0, n_full * SUBS, num_stages=PIPE_STAGES):
        if DENSE:
            kstart = it * BLOCK_N
        else:
            blk = tl.load(IdxBlocks + seg_start + it // SUBS)
            kstart = blk * BLOCK_SIZE + (it % SUBS) * BLOCK_N
        m_i, l_i, acc = _attend_subtile(
            q, first_abs, m_i, l_i, acc, qk_scale, k_head, v_head, pt_row, kstart, kv_len,
            stride_kp, stride_ks, stride_vp, stride_vs, PAGE_SIZE, HEAD_DIM, BLOCK_N, False, P_SHIFT, DOT_KIND,
        )  # fmt: skip

    # ---- phase 2: the diagonal band, causal and tail masks
    # Absolute position of each row, rebuilt from reloaded metadata: see _segment.
    _b, _h, t2, _q_start, q_len2, kv_len2 = _segment(
        pid, SegRequest, TileOffsets, CuSeqlensQ, SeqlensK, NUM_KV_HEADS, True
    )
    q_abs = kv_len2 - q_len2 + (t2 * BLOCK_M + tl.arange(0, BLOCK_M)) // GROUP
    for it in range(n_full * SUBS, n_total * SUBS):
        if DENSE:
            kstart = it * BLOCK_N
        else:
            blk = tl.load(IdxBlocks + seg_start + it // SUBS)
            kstart = blk * BLOCK_SIZE + (it % SUBS) * BLOCK_N
        if kstart <= last_abs:  # sub-tiles past the tile's last query are invisible to all rows
            m_i, l_i, acc = _attend_subtile(
                q, q_abs, m_i, l_i, acc, qk_scale, k_head, v_head, pt_row, kstart, kv_len,
                stride_kp, stride_ks, stride_vp, stride_vs, PAGE_SIZE, HEAD_DIM, BLOCK_N, True, P_SHIFT, DOT_KIND,
            )  # fmt: skip

    # ---- phase 3: mean correction of pruned eligible blocks, chunk by chunk
    if CORRECTION:
        if FP8:
            # Pooled statistics are in real units: q needs its descale, and the pooled values
            # are brought into the FP8 V units the accumulator holds (v_descale comes last).
            corr_scale = sm_scale_log2 * q_descale
            v_units = 1.0 / tl.load(VDescale + b * NUM_KV_HEADS + h)
        else:
            corr_scale = sm_scale_log2
            v_units = 1.0
        n_elig = first_abs // BLOCK_SIZE  # J < (prefix + p_first) // Bk
        # Kept blocks below n_elig: the first n_full kept ids lie below full_limit, which is
        # n_elig or n_elig + 1; when every eligible block is kept there is nothing to add.
        last_full = tl.load(IdxBlocks + seg_start + n_full - 1, mask=n_full > 0, other=-1)
        n_kept_elig = n_full - (last_full >= n_elig).to(tl.int32)
        if n_kept_elig < n_elig:
            boff = tl.load(BlockOffsets + b)
            w_start = tl.load(TodoOffsets + pid)
            w_end = tl.load(TodoOffsets + pid + 1)
            offs_c = tl.arange(0, CORR_N)
            if CORR_KIND == 0:
                q_c = q.to(tl.float32)
            elif CORR_KIND == 1:
                q_c = q.to(tl.float16)
            else:
                q_c = q.to(tl.bfloat16)
            if SECOND_ORDER:
                # min(scale^2 |q|^2 var / 2, scale |q| rad) in log2 units, with qn = scale |q| log2(e) in
                # real units (corr_scale carries the FP8 query descale): min(ln2 qn^2 / 2 * var, qn * rad).
                q_f = q.to(tl.float32)
                q_norm = tl.sqrt(tl.sum(q_f * q_f, 1)) * corr_scale
                shift_a = 0.34657359027997264 * q_norm * q_norm
                shift_b = q_norm
            else:
                shift_a = tl.zeros([BLOCK_M], tl.float32)
                shift_b = shift_a
            # CORR_N pooled vectors per step (a 64-bit todo word covers CHUNK = 64 of them).
            # No per-step branch: a step whose todo bits are all clear adds exp2(-inf) = 0.
            for c in tl.range(0, tl.cdiv(n_elig, CORR_N), num_stages=CORR_STAGES):
                blk_c = c * CORR_N + offs_c
                eligible = blk_c < n_elig
                w_idx = w_start + blk_c // CHUNK
                word = tl.load(TodoMasks + w_idx, mask=eligible & (w_idx < w_end), other=0)
                todo = eligible & (((word >> (blk_c % CHUNK).to(tl.int64)) & 1) != 0)
                m_i, l_i, acc = _correct_chunk(
                    q_c, PooledK + h * stride_ph, PooledV + h * stride_ph, (boff + blk_c).to(tl.int64), stride_pb,
                    BlockLengths, eligible, todo, m_i, l_i, acc, corr_scale, v_units, shift_a, shift_b,
                    KeyVariance + h, KeyRadius + h, stride_sb, HEAD_DIM, P_SHIFT, CORR_KIND, FP8, SECOND_ORDER,
                )  # fmt: skip

    # ---- epilogue: normalise, write the rows of this tile (rows that saw nothing get 0 / -inf)
    _b, h, t, q_start, q_len, _kv_len = _segment(pid, SegRequest, TileOffsets, CuSeqlensQ, SeqlensK, NUM_KV_HEADS, True)
    rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * GROUP
    token = (q_start + rows // GROUP).to(tl.int64)
    head = h * GROUP + rows % GROUP
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if FP8:
        out = out * tl.load(VDescale + b * NUM_KV_HEADS + h)
    o_ptrs = Out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe) - P_SHIFT) * 0.6931471805599453, float("-inf"))
        tl.store(Lse + token * stride_lt + head * stride_lh, lse, mask=row_ok)
