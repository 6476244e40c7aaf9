"""Fused single-pass scoring and max-threshold selection, one segment at a time.

A persistent grid of ``P`` programs walks the (request, KV head, query tile)
segments, heaviest tiles (the last ones of the batch) first. For its segment a
program:

1. finds its request from ``cu_seqlens_q`` (a vector prefix sum over the
   batch, redone only when the walk crosses into another request), loads the
   tile's packed query rows once (PackGQA: row ``r`` is position ``r // g`` of
   query head ``h * g + r % g``; with ``probe_stride = s`` only rows
   ``0, s, 2s, ...`` of the tile);
2. walks the scored pooled keys ``J < num_scored`` once, ``block_n`` at a time
   (:mod:`.tuning`): logits ``s_rJ`` in log2 units (the keys come prescaled by
   ``scale * log2(e)``; the FP8 query descale is applied per logit), row ``r``
   contributing to ``J`` only when ``J * Bk <= prefix + p_r``; for every block
   of the step its log2 energy ``L_J = log2(sum_r 2^s_rJ)`` goes to the
   program's workspace row, and a running maximum ``L_max`` is kept. Steps in
   which every row sees every block (all but the last one or two of a tile)
   run without any mask: a max, a subtraction, an ``exp2`` and a sum per logit;
3. walks the visible blocks once more, reading ``L_J`` back: keeps ``J`` when
   ``2^(L_J - L_max) >= alpha``, i.e. the reference's ``E_J >= alpha * max E``,
   or when it is forced (sink, window, diagonal band) or the tile is dense;
   writes the keep bits (one bit per block, two int32 words per 64 blocks) and
   the segment's count.

Program 0 also writes the index's ``tile_offsets`` and ``offsets[0] = 0``, so
the host launches no metadata kernels. The last program to finish (the one
whose increment of the workspace's completion counter sees ``P - 1`` earlier
ones) turns the counts into ``offsets[1:] = cumsum(counts)``, a few
4096-count steps on one SM while the others drain, and sets the counter back
to 0 for the next call (also under CUDA graph replay): no separate prefix-sum
launch. Each program's count stores precede its counter increment (a CTA
barrier, then an acq_rel atomic at GPU scope); the last program reads the
counts after its own acq_rel atomic and a CTA barrier, through L2 (``.cg``).

With ``tiles_per_program = 2`` (:mod:`.tuning`) a unit of work is two adjacent
tiles ``2u, 2u + 1`` of one request and KV head (the second absent for the last
unit of a request with an odd number of tiles). Pass 1 walks the union of their
candidates once: each pooled-key chunk is loaded (one ``cp.async`` wait and its
barriers) for two GEMMs and two independent exp2/reduction chains, each tile
masking and storing its own energies to its own workspace row; pass 2 runs per
tile. Each tile's energies are computed exactly as with one tile per program
(same operands, same reductions), so the index is the same. A step is unmasked
when it is for every tile that has candidates: adjacent tiles are ``T / g``
positions apart, so the second tile usually runs at most one step masked that
it would have run unmasked alone.

Opt-in variants of the per-step work (:class:`.tuning.ScoreTuning`, all off by
default; each gives the default's index, ``poly_exp2`` up to near-threshold
flips): ``tree_max`` reduces each block's maximum as a pairwise tree in
registers; ``light_tail`` scores the steps after the unmasked ones of a tile
whose rows all see every candidate with block-id masks only (``MASKED=2`` of
:func:`_step_energies`); ``snake_order`` hands the units to the programs in a
boustrophedon order; ``key_prefetch`` loads each step's keys into registers one
step ahead instead of through Triton's ``cp.async`` pipeline
(:func:`_walk_prefetched`); ``poly_exp2`` computes part of the exponentials
with a polynomial on the FMA pipe (:func:`_exp2_poly`).

Relation to the reference's online pass (one running tile maximum ``M`` and
``E_J = sum_r 2^(s_rJ - M)``, earlier chunks rescaled when ``M`` grows): the
selection rule only uses ratios ``E_J / max E``, in which any common factor
``2^-M`` cancels. A block's energy is complete once its step is scored (every
row of the tile meets it there), so instead of rescaling earlier steps the
kernel stores each energy in log2 units, ``L_J = log2 E_J + M``, computed
against the block's own row maximum: the same numbers without underflow, and
with the maxima and sums of a step reduced within warps (logits are laid out
(block, row)), so the loop body has no cross-warp reduction. The only state
is ``L_max`` and one row of ``Nb`` floats per program: no logit matrix, no
sort, no ``L x L/B`` buffer. Results differ from the reference only by
rounding (and for ``alpha`` below ``2^-126``, where the reference's energies
underflow).

Dot precision: fp16 and fp32 queries score with their own dtype (fp32 in
IEEE mode); bf16 queries score in bf16 on GPUs (fp32 accumulation) and in fp32
under the Triton interpreter (whose bf16 ``tl.dot`` is broken); FP8 queries are
upcast to fp16 (exact for e4m3). Pooled keys (fp32, real units) are scaled by
``scale * log2(e)`` and cast to the dot dtype once per call by
:func:`launch_prepare_keys` (one rounding, as the plain cast had).

On GPUs the pass-1 loops are ``range()`` loops so Triton pipelines the
pooled-key loads; under the interpreter they are ``while`` loops, because the
Triton 3.6 interpreter cannot take a loaded value as a ``range()`` bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fpv2.kernel.triton.relaunch import Relauncher

from . import tuning
from .prepared_keys import DOT_BF16 as DOT_BF16  # re-exported: the dot kinds and LOG2E used to live here
from .prepared_keys import DOT_DTYPES
from .prepared_keys import DOT_FP16 as DOT_FP16
from .prepared_keys import DOT_FP32 as DOT_FP32
from .prepared_keys import LOG2E as LOG2E
from .scan import scan_counts
from .tuning import next_power_of_2
from .workspace import CHUNK_BLOCKS, WORD_BITS, WorkspaceViews

#: Largest number of blocks pass 2 thresholds per step (one round trip to the energies row per step).
PASS2_MAX_BLOCKS = 1024


def pass2_blocks(max_blocks: int) -> int:
    """Blocks per pass-2 step: the energies row rounded up to a power of two, between 64 and 1024.

    Args:
        max_blocks: the largest number of key blocks of a request (``Nb``).

    Returns:
        A power of two, a multiple of :data:`CHUNK_BLOCKS`.
    """
    return min(PASS2_MAX_BLOCKS, max(CHUNK_BLOCKS, next_power_of_2(max(max_blocks, 1))))


def score_rows(tile_size: int, probe_stride: int) -> int:
    """Scored rows per tile in the kernel: ``ceil(tile_size / probe_stride)`` padded to a power of two >= 16.

    Args:
        tile_size: packed rows per tile.
        probe_stride: score every ``probe_stride``-th row.

    Returns:
        The row count of the kernel's query operand.
    """
    return max(16, next_power_of_2(-(-tile_size // probe_stride)))


#: Elements per program of the key preparation kernel.
PREPARE_ELEMENTS = 4096


@triton.jit
def _prepare_keys_kernel(src_ptr, dst_ptr, numel, scale, ELEMENTS: tl.constexpr):
    """``dst = (src * scale).to(dst dtype)``: pooled keys in log2 logit units, in the dot dtype."""
    offs = tl.program_id(0).to(tl.int64) * ELEMENTS + tl.arange(0, ELEMENTS)
    ok = offs < numel
    x = tl.load(src_ptr + offs, mask=ok, other=0.0)
    tl.store(dst_ptr + offs, (x * scale).to(dst_ptr.dtype.element_ty), mask=ok)


#: Launcher of the key preparation kernel (direct relaunch of the compiled kernel, :mod:`.launcher`).
_PREPARE = Relauncher(_prepare_keys_kernel)


def launch_prepare_keys(pooled_k: torch.Tensor, scale_log2: float, dot_kind: int) -> torch.Tensor:
    """Pooled keys times ``scale_log2``, cast to the dot dtype (one launch, one rounding).

    Args:
        pooled_k: ``(total_blocks, Hkv, d) float32`` contiguous pooled keys.
        scale_log2: logit scale in log2 units (softmax scale times ``log2(e)``).
        dot_kind: :data:`DOT_FP32`, :data:`DOT_FP16` or :data:`DOT_BF16`.

    Returns:
        The prepared keys, same shape, contiguous.
    """
    keys = torch.empty(pooled_k.shape, dtype=DOT_DTYPES[dot_kind], device=pooled_k.device)
    numel = pooled_k.numel()
    if numel:
        grid = (-(-numel // PREPARE_ELEMENTS),)
        _PREPARE(grid, pooled_k, keys, numel, scale_log2, ELEMENTS=PREPARE_ELEMENTS, num_warps=4)
    return keys


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """``log2(x)``; on GPUs the one-instruction ``lg2.approx`` (relative error ~2^-22), not libdevice's
    polynomial, which sits on the critical path of every scoring step."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@triton.jit
def _store_energies(ptrs, energy, mask, MASKED: tl.constexpr, MMA_STORE: tl.constexpr):
    """Store one step's log2 energies.

    ``MMA_STORE`` writes them from the layout the per-block reductions leave them in (each value is
    held by the 4 lanes of a quad; all 4 write the same word): ``tl.store`` would first move them to
    a one-value-per-thread layout through shared memory and a CTA barrier, once per step. Inline
    PTX is not a memory operation to Triton's coalescing pass, so it keeps the layout as it is.
    """
    if MMA_STORE:
        if MASKED:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }",
                "=r,l,f,r",
                [ptrs.to(tl.int64), energy, mask.to(tl.int32)],  # the addresses as integers: no ptr/float mix
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            tl.inline_asm_elementwise(
                "st.global.f32 [$1], $2; mov.u32 $0, 0;",
                "=r,l,f",
                [ptrs.to(tl.int64), energy],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    elif MASKED:
        tl.store(ptrs, energy, mask=mask)
    else:
        tl.store(ptrs, energy)


@triton.jit
def _load_keys(
    keys_row,
    c0,
    num_loaded,
    stride_pk_block,
    head_dim,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Pooled keys ``c0 .. c0 + BLOCK_N - 1`` (rows at or past ``num_loaded`` read as 0 when ``MASKED``)."""
    ids = c0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    ptrs = keys_row + ids.to(tl.int64)[:, None] * stride_pk_block + dims[None, :]
    if MASKED:
        kbar = tl.load(ptrs, mask=(ids < num_loaded)[:, None] & (dims < head_dim)[None, :], other=0.0)
    elif EVEN_D:
        kbar = tl.load(ptrs)
    else:
        kbar = tl.load(ptrs, mask=(dims < head_dim)[None, :], other=0.0)
    return kbar


@triton.jit
def _logits(kbar, q_t, descale, DOT_KIND: tl.constexpr, HAS_Q_DESCALE: tl.constexpr):
    """``(BLOCK_N, rows)`` log2-unit logits of the loaded keys against a tile's rows."""
    if DOT_KIND == 0:
        logits = tl.dot(kbar, q_t, input_precision="ieee")
    else:
        logits = tl.dot(kbar, q_t)
    if HAS_Q_DESCALE:
        logits = logits * descale
    return logits


@triton.jit
def _split_top(x, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(x[:, :ROWS/2], x[:, ROWS/2:])`` of ``(BLOCK_N, ROWS)`` values, register relabelings only while
    ``ROWS/2 >= 8`` (the column bits a thread holds in the MMA accumulator layout, see :func:`_tree_max`)."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_N, 2, ROWS // 2)), (0, 2, 1)))


@triton.jit
def _tree_max(x, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``tl.max(x, axis=1)`` of ``(BLOCK_N, ROWS)`` logits as a pairwise tree: the same values, a shorter chain.

    Triton reduces the values a thread holds one after the other (31 dependent ``FMNMX`` per block for 128
    rows). Here column ``j`` is first paired with ``j + ROWS/2``, then with ``j + ROWS/4``, ... while the
    pairs lie in one thread (in the MMA accumulator layout a thread holds columns ``c + 8 i``, ``c + 8 i + 1``),
    so the halving steps are independent maxima in registers (no shared memory: the reshapes only relabel
    registers); the last 8 columns go through ``tl.max`` (in-thread pair, then two shuffles). A maximum does
    not depend on the order: the result is bit-identical.
    """
    if ROWS > 8:
        low, high = _split_top(x, ROWS, BLOCK_N)
        return _tree_max(tl.maximum(low, high), ROWS // 2, BLOCK_N)
    else:
        return tl.max(x, axis=1)


@triton.jit
def _block_max(logits, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, TREE_MAX: tl.constexpr):
    """Per-block maximum over the tile's rows (``TREE_MAX``: :func:`_tree_max`, same values)."""
    if TREE_MAX:
        return _tree_max(logits, ROWS, BLOCK_N)
    else:
        return tl.max(logits, axis=1)


@triton.jit
def _exp2_poly(x):
    """``2^x`` for finite ``x <= 0`` on the FMA pipe instead of the SFU.

    ``x = j + f`` with ``j = round(x)`` (adding and subtracting ``1.5 * 2^23``) and ``|f| <= 1/2``; ``2^f``
    from a degree-5 polynomial (coefficients fitted here to the relative error: at most 2.4e-7 in fp32
    Horner form, about the error of the hardware ``ex2.approx``); ``j`` added to its exponent bits (the low
    bits of ``x + 1.5 * 2^23`` hold ``j``). ``x`` is clamped at -120: results below ``2^-120`` come out as
    ``2^-120``, which next to a block's largest term (1) does not change its sum. Ten instructions (FMNMX,
    3 FADD, 5 FFMA, one integer op) instead of one ``MUFU.EX2``, which issues once per 8 cycles per warp
    scheduler.
    """
    x = tl.maximum(x, -120.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = tl.fma(f, 0.0013276466634124517, 0.009675541892647743)
    p = tl.fma(p, f, 0.05550713464617729)
    p = tl.fma(p, f, 0.24022120237350464)
    p = tl.fma(p, f, 0.6931469440460205)
    p = tl.fma(p, f, 1.0000001192092896)
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_sum(x, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, POLY: tl.constexpr):
    """``tl.sum(tl.exp2(x), axis=1)`` of ``(BLOCK_N, ROWS)`` finite exponents ``<= 0``.

    ``POLY = 1`` computes the top quarter of the columns with :func:`_exp2_poly` (needs ``ROWS >= 32``),
    ``POLY = 2`` the top half (``ROWS >= 16``); otherwise, or with fewer rows, all with ``tl.exp2``. The
    partial results are added elementwise before the one row reduction. Not the default's rounding
    (another summation order, another exponential): energies move by about 1e-7 relative.
    """
    if POLY == 1 and ROWS >= 32:
        low, high = _split_top(x, ROWS, BLOCK_N)
        mufu, poly = _split_top(high, ROWS // 2, BLOCK_N)
        low_a, low_b = _split_top(tl.exp2(low), ROWS // 2, BLOCK_N)
        return tl.sum((low_a + low_b) + (tl.exp2(mufu) + _exp2_poly(poly)), axis=1)
    elif POLY == 2 and ROWS >= 16:
        low, high = _split_top(x, ROWS, BLOCK_N)
        return tl.sum(tl.exp2(low) + _exp2_poly(high), axis=1)
    else:
        return tl.sum(tl.exp2(x), axis=1)


@triton.jit
def _step_energies(
    logits,
    energies_row,
    c0,
    num_candidates,
    positions,
    energy_max,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MMA_STORE: tl.constexpr,
    ROWS: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
):
    """One tile's share of a pass-1 step: log2 energies of its logits, stored, and the running maxima.

    ``MASKED`` is 0 (False) for steps whose blocks every probed row sees
    (``J * Bk <= first position``, ``J < num_candidates``): no mask per logit;
    1 (True) masks every logit by its row's position and its block id; 2 is for
    the steps after the unmasked ones of a tile whose probed rows all see every
    candidate (``light`` of :func:`_tile_geometry`): the logits are reduced
    unmasked and only the per-block results are masked by id (ids at or past
    ``num_candidates`` hold zero keys, or another tile's candidates; their
    energies are neither stored nor counted): the same values as ``MASKED=1``
    for every candidate, with the work of an unmasked step.
    Logits are laid out (block, row), so the per-block maximum and sum over rows
    are reductions within a warp: the loop body has no cross-warp reduction.
    """
    ids = c0 + tl.arange(0, BLOCK_N)
    if MASKED == 2:
        id_ok = ids < num_candidates
        block_max = _block_max(logits, ROWS, BLOCK_N, TREE_MAX)
        energy = block_max + _log2(_exp2_sum(logits - block_max[:, None], ROWS, BLOCK_N, POLY), FAST_LOG2)
        _store_energies(energies_row + ids, energy, id_ok, True, MMA_STORE)
        return tl.maximum(energy_max, tl.where(id_ok, energy, float("-inf")))
    elif MASKED:
        id_ok = ids < num_candidates
        contributes = id_ok[:, None] & (ids[:, None] * BLOCK_SIZE <= positions[None, :])
        logits = tl.where(contributes, logits, float("-inf"))
        block_max = _block_max(logits, ROWS, BLOCK_N, TREE_MAX)
        offset = tl.where(block_max == float("-inf"), 0.0, block_max)
        # log2(sum_r 2^s_rJ), offset by the block's own maximum so nothing underflows; -inf when no row contributes.
        energy = offset + _log2(tl.sum(tl.exp2(logits - offset[:, None]), axis=1), FAST_LOG2)
        _store_energies(energies_row + ids, energy, id_ok, True, MMA_STORE)
        return tl.maximum(energy_max, tl.where(id_ok, energy, float("-inf")))
    else:
        block_max = _block_max(logits, ROWS, BLOCK_N, TREE_MAX)
        if POLY:
            energy = block_max + _log2(_exp2_sum(logits - block_max[:, None], ROWS, BLOCK_N, POLY), FAST_LOG2)
        else:
            energy = block_max + _log2(tl.sum(tl.exp2(logits - block_max[:, None]), axis=1), FAST_LOG2)
        _store_energies(energies_row + ids, energy, ids >= 0, False, MMA_STORE)
        return tl.maximum(energy_max, energy)


@triton.jit
def _score_step(
    q_t,
    keys_row,
    energies_row,
    c0,
    num_candidates,
    positions,
    descale,
    energy_max,
    stride_pk_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    MASKED: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MMA_STORE: tl.constexpr,
    ROWS: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
):
    """One step of pass 1 for one tile: load keys ``c0 .. c0 + BLOCK_N - 1``, score them (:func:`_step_energies`)."""
    kbar = _load_keys(keys_row, c0, num_candidates, stride_pk_block, head_dim, BLOCK_N, BLOCK_D, EVEN_D, MASKED)
    logits = _logits(kbar, q_t, descale, DOT_KIND, HAS_Q_DESCALE)
    return _step_energies(
        logits, energies_row, c0, num_candidates, positions, energy_max, BLOCK_SIZE, BLOCK_N, MASKED, FAST_LOG2,
        MMA_STORE, ROWS, TREE_MAX, POLY,
    )  # fmt: skip


@triton.jit
def _pair_step(
    q_t_a,
    q_t_b,
    keys_row,
    energies_a,
    energies_b,
    c0,
    candidates_a,
    candidates_b,
    candidates_pair,
    positions_a,
    positions_b,
    descale,
    max_a,
    max_b,
    stride_pk_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    MASKED: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MMA_STORE: tl.constexpr,
    ROWS: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
):
    """One step of pass 1 for two tiles: one load of keys ``c0 .. c0 + BLOCK_N - 1`` scored against both.

    The load covers the union of the tiles' candidates; each tile masks (and stores) its own.
    """
    kbar = _load_keys(keys_row, c0, candidates_pair, stride_pk_block, head_dim, BLOCK_N, BLOCK_D, EVEN_D, MASKED)
    logits_a = _logits(kbar, q_t_a, descale, DOT_KIND, HAS_Q_DESCALE)
    logits_b = _logits(kbar, q_t_b, descale, DOT_KIND, HAS_Q_DESCALE)
    max_a = _step_energies(
        logits_a, energies_a, c0, candidates_a, positions_a, max_a, BLOCK_SIZE, BLOCK_N, MASKED, FAST_LOG2, MMA_STORE,
        ROWS, TREE_MAX, POLY,
    )  # fmt: skip
    max_b = _step_energies(
        logits_b, energies_b, c0, candidates_b, positions_b, max_b, BLOCK_SIZE, BLOCK_N, MASKED, FAST_LOG2, MMA_STORE,
        ROWS, TREE_MAX, POLY,
    )  # fmt: skip
    return max_a, max_b


@triton.jit
def _walk(
    q_t,
    keys_row,
    energies_row,
    c_begin,
    c_end,
    num_candidates,
    positions,
    descale,
    energy_max,
    stride_pk_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    MASKED: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MMA_STORE: tl.constexpr,
    ROWS: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
    USE_WHILE: tl.constexpr,
    PIPELINE: tl.constexpr = True,
):
    """Pass-1 steps ``c_begin, c_begin + BLOCK_N, ... < c_end`` of one tile (:func:`_score_step`).

    The ``range()`` form lets Triton pipeline the pooled-key loads (``cp.async``, ``num_stages`` buffers);
    ``PIPELINE=False`` asks for none (``num_stages=1``: no prologue issuing the first load before the loop,
    for loops of at most one step or none). The interpreter takes the ``while`` form (it cannot use loaded
    values as ``range()`` bounds).
    """
    if USE_WHILE:
        c0 = c_begin
        while c0 < c_end:
            energy_max = _score_step(
                q_t, keys_row, energies_row, c0, num_candidates, positions, descale, energy_max, stride_pk_block,
                head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, MASKED, FAST_LOG2, MMA_STORE,
                ROWS, TREE_MAX, POLY,
            )  # fmt: skip
            c0 += BLOCK_N
    elif PIPELINE:
        for c0 in range(c_begin, c_end, BLOCK_N):
            energy_max = _score_step(
                q_t, keys_row, energies_row, c0, num_candidates, positions, descale, energy_max, stride_pk_block,
                head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, MASKED, FAST_LOG2, MMA_STORE,
                ROWS, TREE_MAX, POLY,
            )  # fmt: skip
    else:
        for c0 in tl.range(c_begin, c_end, BLOCK_N, num_stages=1):
            energy_max = _score_step(
                q_t, keys_row, energies_row, c0, num_candidates, positions, descale, energy_max, stride_pk_block,
                head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, MASKED, FAST_LOG2, MMA_STORE,
                ROWS, TREE_MAX, POLY,
            )  # fmt: skip
    return energy_max


@triton.jit
def _walk_prefetched(
    kbar,
    q_t,
    keys_row,
    energies_row,
    c_begin,
    c_end,
    num_candidates,
    positions,
    descale,
    energy_max,
    stride_pk_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    MASKED: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MMA_STORE: tl.constexpr,
    ROWS: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
    USE_WHILE: tl.constexpr,
):
    """Pass-1 steps like :func:`_walk`, each step's keys loaded to registers one step ahead.

    ``kbar`` holds the keys of step ``c_begin`` (loaded by the caller). Each step copies them to shared
    memory for its GEMM (a barrier for the previous step's readers, the copy, the async-proxy fence, a
    barrier), issues the load of the next step's keys right after the GEMM (masked by ``num_candidates``:
    past the last candidate it reads nothing; after the fence, which could otherwise wait for it), then
    reduces its logits. The load of step ``i + 1`` so has the exponentials, reductions and store of step
    ``i`` to arrive, where Triton's two-stage ``cp.async`` pipeline issues it at the end of step ``i`` and
    waits for it at the top of step ``i + 1`` (the L2 latency exposed once per step). Not pipelined by
    Triton (``num_stages=1``). Same operands and reductions as :func:`_walk`: the same energies.

    Returns:
        ``(running maxima, keys of step c_end)`` (the latter for a following walk).
    """
    if USE_WHILE:
        c0 = c_begin
        while c0 < c_end:
            logits = _logits(kbar, q_t, descale, DOT_KIND, HAS_Q_DESCALE)
            kbar_next = _load_keys(
                keys_row, c0 + BLOCK_N, num_candidates, stride_pk_block, head_dim, BLOCK_N, BLOCK_D, EVEN_D, True
            )
            energy_max = _step_energies(
                logits, energies_row, c0, num_candidates, positions, energy_max, BLOCK_SIZE, BLOCK_N, MASKED,
                FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY,
            )  # fmt: skip
            kbar = kbar_next
            c0 += BLOCK_N
    else:
        for c0 in tl.range(c_begin, c_end, BLOCK_N, num_stages=1):
            logits = _logits(kbar, q_t, descale, DOT_KIND, HAS_Q_DESCALE)
            kbar_next = _load_keys(
                keys_row, c0 + BLOCK_N, num_candidates, stride_pk_block, head_dim, BLOCK_N, BLOCK_D, EVEN_D, True
            )
            energy_max = _step_energies(
                logits, energies_row, c0, num_candidates, positions, energy_max, BLOCK_SIZE, BLOCK_N, MASKED,
                FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY,
            )  # fmt: skip
            kbar = kbar_next
    return energy_max, kbar


@triton.jit
def _walk_tail(
    light,
    q_t,
    keys_row,
    energies_row,
    c_begin,
    num_candidates,
    positions,
    descale,
    energy_max,
    stride_pk_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MMA_STORE: tl.constexpr,
    ROWS: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
    LIGHT_TAIL: tl.constexpr,
    USE_WHILE: tl.constexpr,
):
    """The steps from ``c_begin`` (after the unmasked ones) to the last candidate of one tile: masked by block
    id only (``MASKED=2``) with ``LIGHT_TAIL`` when ``light`` (every row sees every candidate), else per logit.

    With ``LIGHT_TAIL`` both loops are always there, one of them empty: a loop under a runtime ``if`` would
    get shared-memory buffers that Triton's allocator keeps apart from the other branch's (96 KB instead of
    64 KB per program: two programs per SM instead of three). Neither is pipelined: a light tail is one step
    (fewer than ``BLOCK_N`` blocks remain after the unmasked steps), and a pipelined loop's prologue (the first
    load's addresses and masks, some 700 instructions for the per-logit masked loop) runs even when the loop
    is empty.
    """
    if LIGHT_TAIL:
        split = tl.where(light, num_candidates, c_begin)
        energy_max = _walk(
            q_t, keys_row, energies_row, c_begin, split, num_candidates, positions, descale, energy_max,
            stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, 2,
            FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE, False,
        )  # fmt: skip
        energy_max = _walk(
            q_t, keys_row, energies_row, split, num_candidates, num_candidates, positions, descale, energy_max,
            stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, True,
            FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE, False,
        )  # fmt: skip
    else:
        energy_max = _walk(
            q_t, keys_row, energies_row, c_begin, num_candidates, num_candidates, positions, descale, energy_max,
            stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, True,
            FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE,
        )  # fmt: skip
    return energy_max


@triton.jit
def _walk_prefetched_tail(
    light,
    kbar,
    q_t,
    keys_row,
    energies_row,
    c_begin,
    num_candidates,
    positions,
    descale,
    energy_max,
    stride_pk_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MMA_STORE: tl.constexpr,
    ROWS: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
    LIGHT_TAIL: tl.constexpr,
    USE_WHILE: tl.constexpr,
):
    """:func:`_walk_tail` for :func:`_walk_prefetched` (``kbar``: the keys of step ``c_begin``)."""
    split = c_begin
    if LIGHT_TAIL:
        split = tl.where(light, num_candidates, c_begin)
        energy_max, kbar = _walk_prefetched(
            kbar, q_t, keys_row, energies_row, c_begin, split, num_candidates, positions, descale, energy_max,
            stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, 2, FAST_LOG2,
            MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE,
        )  # fmt: skip
    energy_max, kbar = _walk_prefetched(
        kbar, q_t, keys_row, energies_row, split, num_candidates, num_candidates, positions, descale, energy_max,
        stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, 1, FAST_LOG2,
        MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE,
    )  # fmt: skip
    return energy_max


@triton.jit
def _pair_walk(
    q_t_a,
    q_t_b,
    keys_row,
    energies_a,
    energies_b,
    c_begin,
    c_end,
    candidates_a,
    candidates_b,
    candidates_pair,
    positions_a,
    positions_b,
    descale,
    max_a,
    max_b,
    stride_pk_block,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    MASKED: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    MMA_STORE: tl.constexpr,
    ROWS: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
    USE_WHILE: tl.constexpr,
    PIPELINE: tl.constexpr = True,
):
    """Pass-1 steps ``c_begin .. < c_end`` of two tiles (:func:`_pair_step`; loop forms as in :func:`_walk`)."""
    if USE_WHILE:
        c0 = c_begin
        while c0 < c_end:
            max_a, max_b = _pair_step(
                q_t_a, q_t_b, keys_row, energies_a, energies_b, c0, candidates_a, candidates_b, candidates_pair,
                positions_a, positions_b, descale, max_a, max_b, stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N,
                BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, MASKED, FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY,
            )  # fmt: skip
            c0 += BLOCK_N
    elif PIPELINE:
        for c0 in range(c_begin, c_end, BLOCK_N):
            max_a, max_b = _pair_step(
                q_t_a, q_t_b, keys_row, energies_a, energies_b, c0, candidates_a, candidates_b, candidates_pair,
                positions_a, positions_b, descale, max_a, max_b, stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N,
                BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, MASKED, FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY,
            )  # fmt: skip
    else:
        for c0 in tl.range(c_begin, c_end, BLOCK_N, num_stages=1):
            max_a, max_b = _pair_step(
                q_t_a, q_t_b, keys_row, energies_a, energies_b, c0, candidates_a, candidates_b, candidates_pair,
                positions_a, positions_b, descale, max_a, max_b, stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N,
                BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, MASKED, FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY,
            )  # fmt: skip
    return max_a, max_b


@triton.jit
def _tile_geometry(
    tile,
    cur_tiles,
    prefix,
    q_len,
    kv_len,
    group,
    window_tokens,
    dense_tail_tiles,
    min_sparse_kv_len,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FULL_ROWS: tl.constexpr,
):
    """Rows, visible / scored / forced blocks and the unmasked step limit of ``tile`` of the cached request.

    All quantities are non-negative (integer division is floor division), also for ``tile == cur_tiles``
    (the absent second tile of a pair), which comes out dense with no candidates. The last value,
    ``light``, says that every probed row sees every candidate (true, e.g., for all full tiles whose
    positions lie within one block, as with 128 rows of ``g = 4`` and ``Bk = 128``): then the steps after
    the unmasked ones need masks by block id only (``MASKED=2`` of :func:`_step_energies`).
    """
    row_begin = tile * TILE
    row_end = tl.minimum(row_begin + TILE, q_len * group)
    first = prefix + row_begin // group
    last = prefix + (row_end - 1) // group
    num_visible = last // BLOCK_SIZE + 1
    num_scored = (last + 1) // BLOCK_SIZE
    first_diagonal = first // BLOCK_SIZE
    dense = (tile >= cur_tiles - dense_tail_tiles) | (kv_len < min_sparse_kv_len)
    num_candidates = tl.where(dense, 0, num_scored)
    # Blocks every probed row sees (J * Bk <= first), in whole steps: scored without masks.
    if FULL_ROWS:
        full = tl.where(row_end - row_begin == TILE, tl.minimum(first // BLOCK_SIZE + 1, num_candidates), 0)
    else:
        full = tile * 0
    num_full = (full // BLOCK_N) * BLOCK_N
    light = full == num_candidates
    has_window = (window_tokens > 0) & (first > 0)
    window_lo = tl.maximum(first - window_tokens, 0) // BLOCK_SIZE
    window_hi = tl.where(has_window, tl.maximum(first - 1, 0) // BLOCK_SIZE, -1)
    return row_begin, row_end, num_visible, num_candidates, num_full, first_diagonal, dense, window_lo, window_hi, light


@triton.jit
def _load_tile_rows(
    q_ptr,
    dot_ptr,
    row_begin,
    row_end,
    prefix,
    q_start,
    head,
    group,
    stride_q_tok,
    stride_q_head,
    head_dim,
    TILE: tl.constexpr,
    PROBE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The tile's (probed) packed rows, transposed, in the dot dtype (that of ``dot_ptr``), and their positions.

    PackGQA: row ``r`` is position ``r // g`` of query head ``head * g + r % g``; rows past ``row_end``
    (or past the tile, when probing pads the row count) are zeros at position -1.
    """
    rows_i = tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    in_tile = rows_i * PROBE
    rows = row_begin + in_tile
    row_ok = (in_tile < TILE) & (rows < row_end)
    positions = tl.where(row_ok, prefix + rows // group, -1)
    tokens = (q_start + rows // group).to(tl.int64)
    q_heads = head * group + rows % group
    q_addr = tokens[:, None] * stride_q_tok + q_heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_addr, mask=row_ok[:, None] & (dims < head_dim)[None, :], other=0.0)
    q = q.to(dot_ptr.dtype.element_ty)  # the dot dtype (keys come cast to it)
    return tl.trans(q), positions


@triton.jit
def _prefetch_tile_rows(
    q_ptr,
    row_begin,
    num_rows,
    q_start,
    head,
    group,
    stride_q_tok,
    stride_q_head,
    valid,
    TILE: tl.constexpr,
    PROBE: tl.constexpr,
    ROWS: tl.constexpr,
    LINES: tl.constexpr,
):
    """``prefetch.global.L2`` of the (probed) packed query rows ``row_begin ..`` of a tile, ``LINES`` 128-byte
    lines per row (CUDA only: inline PTX). Rows past ``num_rows`` (the request's packed rows), and all rows
    unless ``valid``, are skipped: only addresses inside the request's queries are touched. Values unchanged."""
    in_tile = tl.arange(0, ROWS) * PROBE
    rows = row_begin + in_tile
    ok = valid & (in_tile < TILE) & (rows < num_rows) & (rows >= 0)
    tokens = (q_start + rows // group).to(tl.int64)
    addr = (q_ptr + tokens * stride_q_tok + (head * group + rows % group) * stride_q_head).to(tl.int64)
    for line in tl.static_range(LINES):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [addr + line * 128, ok.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _select_tile(
    energies_row,
    bits_row,
    counts_ptr,
    segment,
    energy_max,
    alpha,
    num_visible,
    num_candidates,
    first_diagonal,
    dense,
    sink_blocks,
    window_lo,
    window_hi,
    CHUNK: tl.constexpr,
    PASS2: tl.constexpr,
    WORD: tl.constexpr,
):
    """Pass 2 for one tile: threshold, forced blocks, dense fallback -> keep bits and count.

    ``E_J >= alpha * max E``  <=>  ``2^(log2 E_J - log2 max E) >= alpha``; never when nothing was
    scored (the reference's ``peak > 0``).
    """
    peak_log2 = tl.max(energy_max, axis=0)  # log2 of max_J E_J; -inf when nothing was scored
    # A scalar where, not a scalar-bool broadcast, which the interpreter mistypes.
    threshold = tl.where(peak_log2 == float("-inf"), float("inf"), alpha)
    peak_offset = tl.where(peak_log2 == float("-inf"), 0.0, peak_log2)
    wide = tl.arange(0, PASS2)
    lanes = tl.arange(0, WORD)
    count = segment * 0
    # Whole 64-block chunks up to the visible blocks: what the compaction reads.
    num_words = (num_visible + (CHUNK - 1)) // CHUNK * (CHUNK // WORD)
    c0 = segment * 0
    while c0 < num_visible:  # one or a few wide steps: each costs a round trip to the energies row
        ids = c0 + wide
        scored = ids < num_candidates
        energy = tl.load(energies_row + ids, mask=scored, other=float("-inf"))
        keep = scored & (tl.exp2(energy - peak_offset) >= threshold)
        forced = (ids < sink_blocks) | ((ids >= window_lo) & (ids <= window_hi)) | (ids >= first_diagonal)
        keep = (keep | forced | dense) & (ids < num_visible)
        keep_i = keep.to(tl.int32)
        words = tl.sum(tl.reshape(keep_i, (PASS2 // WORD, WORD)) << lanes[None, :], axis=1)
        word_ids = c0 // WORD + tl.arange(0, PASS2 // WORD)
        tl.store(bits_row + word_ids, words, mask=word_ids < num_words)
        count += tl.sum(keep_i, axis=0)
        c0 += PASS2
    tl.store(counts_ptr + segment, count)


@triton.jit
def _score_select_kernel(
    q_ptr,
    keys_ptr,
    q_descale_ptr,
    cu_seqlens_q_ptr,
    seqlens_k_ptr,
    block_offsets_ptr,
    tile_offsets_ptr,
    offsets_ptr,
    energies_ptr,
    keep_bits_ptr,
    counts_ptr,
    done_ptr,
    stride_q_tok,
    stride_q_head,
    stride_pk_block,
    stride_pk_head,
    num_requests,
    total_units,
    num_kv_heads,
    group,
    head_dim,
    energies_stride,
    bits_stride,
    alpha,
    sink_blocks,
    window_tokens,
    dense_tail_tiles,
    min_sparse_kv_len,
    num_segments,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PROBE: tl.constexpr,
    ROWS: tl.constexpr,
    FULL_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CHUNK: tl.constexpr,
    PASS2: tl.constexpr,
    WORD: tl.constexpr,
    DOT_KIND: tl.constexpr,
    HAS_Q_DESCALE: tl.constexpr,
    USE_WHILE: tl.constexpr,
    FAST_LOG2: tl.constexpr,
    TILES: tl.constexpr,
    MMA_STORE: tl.constexpr,
    SCAN: tl.constexpr,
    TREE_MAX: tl.constexpr,
    POLY: tl.constexpr,
    LIGHT_TAIL: tl.constexpr,
    SNAKE: tl.constexpr,
    PREFETCH: tl.constexpr,
    GROUP: tl.constexpr,
    Q_PREFETCH: tl.constexpr,
):
    if GROUP > 0:  # the group size as a compile-time constant: PackGQA's row // g and row % g without divisions
        group = GROUP
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    zero = pid * 0
    # A unit of work is one tile (TILES = 1) or tiles 2u, 2u + 1 of one request (TILES = 2), for one KV head.
    num_work = total_units * num_kv_heads
    energies_a = energies_ptr + (pid * TILES).to(tl.int64) * energies_stride
    energies_b = energies_a + energies_stride  # the second tile's row (TILES = 2 only)
    req = tl.arange(0, BLOCK_B)
    req_ok = req < num_requests

    # ---- program 0 writes the index metadata: tile_offsets = [0, cumsum(tiles)] and offsets[0] = 0
    first_program = pid == 0
    cu_lo = tl.load(cu_seqlens_q_ptr + req, mask=req_ok & first_program, other=0)
    cu_hi = tl.load(cu_seqlens_q_ptr + req + 1, mask=req_ok & first_program, other=0)
    ends = tl.cumsum(((cu_hi - cu_lo) * group + (TILE - 1)) // TILE, axis=0)
    tl.store(tile_offsets_ptr + 1 + req, ends, mask=req_ok & first_program)
    tl.store(tile_offsets_ptr + req, zero + req * 0, mask=(req == 0) & first_program)
    tl.store(offsets_ptr + req, zero + req * 0, mask=(req == 0) & first_program)

    # The request of the unit at hand, cached: the walk only ever moves to lower global units.
    cur_begin = zero + total_units  # first global unit of the cached request (none cached yet); a tensor, not a
    # constexpr (Triton specialises an int argument equal to 1), so the loop may reassign it
    cur_tiles = zero
    cur_tile_begin = zero  # first global tile of the cached request
    b = zero
    q_start = zero
    q_len = zero
    kv_len = zero
    block_base = zero

    # while loops, not range(): the Triton 3.6 interpreter cannot use loaded values as range() bounds.
    work = pid
    while work < num_work:
        # ---- which unit: the last ones of the batch (the longest rows) first
        unit_global = total_units - 1 - work // num_kv_heads
        head = work % num_kv_heads
        if unit_global < cur_begin:
            lo = tl.load(cu_seqlens_q_ptr + req, mask=req_ok, other=0)
            hi = tl.load(cu_seqlens_q_ptr + req + 1, mask=req_ok, other=0)
            tiles_v = ((hi - lo) * group + (TILE - 1)) // TILE
            ends_v = tl.cumsum(tiles_v, axis=0)
            if TILES == 1:
                unit_ends_v = ends_v
            else:
                unit_ends_v = tl.cumsum((tiles_v + (TILES - 1)) // TILES, axis=0)
            b = tl.sum((req_ok & (unit_ends_v <= unit_global)).to(tl.int32), axis=0)
            sel = req == b
            cur_tiles = tl.sum(tl.where(sel, tiles_v, 0), axis=0)
            cur_tile_begin = tl.sum(tl.where(sel, ends_v, 0), axis=0) - cur_tiles
            cur_begin = tl.sum(tl.where(sel, unit_ends_v, 0), axis=0) - (cur_tiles + (TILES - 1)) // TILES
            q_start = tl.sum(tl.where(sel, lo, 0), axis=0)
            q_len = tl.sum(tl.where(sel, hi - lo, 0), axis=0)
            kv_len = tl.load(seqlens_k_ptr + b)
            block_base = tl.load(block_offsets_ptr + b)
        tile_a = (unit_global - cur_begin) * TILES
        prefix = kv_len - q_len
        segment_a = num_kv_heads * cur_tile_begin + head * cur_tiles + tile_a
        (
            row_begin_a, row_end_a, visible_a, candidates_a, full_a, diagonal_a, dense_a, window_lo_a, window_hi_a,
            light_a,
        ) = _tile_geometry(
            tile_a, cur_tiles, prefix, q_len, kv_len, group, window_tokens, dense_tail_tiles, min_sparse_kv_len,
            TILE, BLOCK_SIZE, BLOCK_N, FULL_ROWS,
        )  # fmt: skip
        if Q_PREFETCH:  # this program's next unit's query rows into L2 (the next Q load then misses only in L1)
            if SNAKE:
                next_round = work // num_programs + 1
                next_work = next_round * num_programs + tl.where(next_round % 2 == 0, pid, num_programs - 1 - pid)
            else:
                next_work = work + num_programs
            next_unit = total_units - 1 - next_work // num_kv_heads
            # Only within the cached request (the next unit's request is not looked up here).
            _prefetch_tile_rows(
                q_ptr, (next_unit - cur_begin) * TILES * TILE, q_len * group, q_start, next_work % num_kv_heads, group,
                stride_q_tok, stride_q_head, (next_work < num_work) & (next_unit >= cur_begin), TILE * TILES, PROBE,
                ROWS * TILES, Q_PREFETCH,
            )  # fmt: skip
        if PREFETCH:  # the first key chunk before the query rows: the two loads' latencies overlap
            keys_row = keys_ptr + block_base.to(tl.int64) * stride_pk_block + head * stride_pk_head
            kbar_a = _load_keys(keys_row, zero, candidates_a, stride_pk_block, head_dim, BLOCK_N, BLOCK_D, EVEN_D, True)
        q_t_a, positions_a = _load_tile_rows(
            q_ptr, keys_ptr, row_begin_a, row_end_a, prefix, q_start, head, group, stride_q_tok, stride_q_head,
            head_dim, TILE, PROBE, ROWS, BLOCK_D,
        )  # fmt: skip
        descale = 1.0
        if HAS_Q_DESCALE:
            descale = tl.load(q_descale_ptr + b * num_kv_heads + head)
        keys_row = keys_ptr + block_base.to(tl.int64) * stride_pk_block + head * stride_pk_head
        max_a = tl.full([BLOCK_N], float("-inf"), tl.float32)  # per lane; reduced once after the walk

        if TILES == 1:
            # ---- pass 1: one walk over the candidate pooled keys; log2 energies to the workspace row. Steps in
            # which every row sees every block first (no masks), then the one or two others: masked by block id only
            # when every row sees every candidate (LIGHT_TAIL and light_a), else per logit.
            if PREFETCH:
                max_a, kbar_a = _walk_prefetched(
                    kbar_a, q_t_a, keys_row, energies_a, 0, full_a, candidates_a, positions_a, descale, max_a,
                    stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, 0,
                    FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE,
                )  # fmt: skip
                max_a = _walk_prefetched_tail(
                    light_a, kbar_a, q_t_a, keys_row, energies_a, full_a, candidates_a, positions_a, descale, max_a,
                    stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE,
                    FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY, LIGHT_TAIL, USE_WHILE,
                )  # fmt: skip
            else:
                max_a = _walk(
                    q_t_a, keys_row, energies_a, 0, full_a, candidates_a, positions_a, descale, max_a,
                    stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, False,
                    FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE,
                )  # fmt: skip
                max_a = _walk_tail(
                    light_a, q_t_a, keys_row, energies_a, full_a, candidates_a, positions_a, descale, max_a,
                    stride_pk_block, head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE,
                    FAST_LOG2, MMA_STORE, ROWS, TREE_MAX, POLY, LIGHT_TAIL, USE_WHILE,
                )  # fmt: skip
            # Pass 2 reads energies other threads of this program wrote.
            tl.debug_barrier()
            _select_tile(
                energies_a, keep_bits_ptr + segment_a.to(tl.int64) * bits_stride, counts_ptr, segment_a, max_a, alpha,
                visible_a, candidates_a, diagonal_a, dense_a, sink_blocks, window_lo_a, window_hi_a, CHUNK, PASS2, WORD,
            )  # fmt: skip
        else:
            # ---- the second tile (tile_a + 1 of the same request and KV head; absent when the request has an odd
            # number of tiles and this is its last unit: then it is dense with no candidates and selects nothing)
            tile_b = tile_a + 1
            has_b = tile_b < cur_tiles
            (
                row_begin_b, row_end_b, visible_b, candidates_b, full_b, diagonal_b, dense_b, window_lo_b,
                window_hi_b, light_b,
            ) = _tile_geometry(
                tile_b, cur_tiles, prefix, q_len, kv_len, group, window_tokens, dense_tail_tiles, min_sparse_kv_len,
                TILE, BLOCK_SIZE, BLOCK_N, FULL_ROWS,
            )  # fmt: skip
            q_t_b, positions_b = _load_tile_rows(
                q_ptr, keys_ptr, row_begin_b, row_end_b, prefix, q_start, head, group, stride_q_tok, stride_q_head,
                head_dim, TILE, PROBE, ROWS, BLOCK_D,
            )  # fmt: skip
            max_b = tl.full([BLOCK_N], float("-inf"), tl.float32)
            # One walk over the union of both tiles' candidates. A step runs unmasked when it is unmasked for
            # every tile that scores; a tile without candidates (dense, or absent) puts no limit on it: its
            # energies there are never read (pass 2 reads only ids < its candidates, i.e. none). The other steps
            # mask by block id only (LIGHT_TAIL) when every row of both tiles sees every candidate of its tile.
            candidates_pair = tl.maximum(candidates_a, candidates_b)
            limit_a = tl.where(candidates_a == 0, candidates_pair, full_a)
            limit_b = tl.where(candidates_b == 0, candidates_pair, full_b)
            full_pair = tl.minimum(limit_a, limit_b)  # a multiple of BLOCK_N
            max_a, max_b = _pair_walk(
                q_t_a, q_t_b, keys_row, energies_a, energies_b, 0, full_pair, candidates_a, candidates_b,
                candidates_pair, positions_a, positions_b, descale, max_a, max_b, stride_pk_block, head_dim,
                BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, False, FAST_LOG2, MMA_STORE, ROWS,
                TREE_MAX, POLY, USE_WHILE,
            )  # fmt: skip
            if LIGHT_TAIL:  # both loops always there, one empty, neither pipelined (see _walk_tail)
                split = tl.where(light_a & light_b, candidates_pair, full_pair)
                max_a, max_b = _pair_walk(
                    q_t_a, q_t_b, keys_row, energies_a, energies_b, full_pair, split, candidates_a, candidates_b,
                    candidates_pair, positions_a, positions_b, descale, max_a, max_b, stride_pk_block, head_dim,
                    BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, 2, FAST_LOG2, MMA_STORE, ROWS,
                    TREE_MAX, POLY, USE_WHILE, False,
                )  # fmt: skip
                max_a, max_b = _pair_walk(
                    q_t_a, q_t_b, keys_row, energies_a, energies_b, split, candidates_pair, candidates_a,
                    candidates_b, candidates_pair, positions_a, positions_b, descale, max_a, max_b, stride_pk_block,
                    head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, True, FAST_LOG2,
                    MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE, False,
                )  # fmt: skip
            else:
                max_a, max_b = _pair_walk(
                    q_t_a, q_t_b, keys_row, energies_a, energies_b, full_pair, candidates_pair, candidates_a,
                    candidates_b, candidates_pair, positions_a, positions_b, descale, max_a, max_b, stride_pk_block,
                    head_dim, BLOCK_SIZE, BLOCK_N, BLOCK_D, EVEN_D, DOT_KIND, HAS_Q_DESCALE, True, FAST_LOG2,
                    MMA_STORE, ROWS, TREE_MAX, POLY, USE_WHILE,
                )  # fmt: skip
            tl.debug_barrier()
            _select_tile(
                energies_a, keep_bits_ptr + segment_a.to(tl.int64) * bits_stride, counts_ptr, segment_a, max_a, alpha,
                visible_a, candidates_a, diagonal_a, dense_a, sink_blocks, window_lo_a, window_hi_a, CHUNK, PASS2, WORD,
            )  # fmt: skip
            if has_b:
                segment_b = segment_a + 1
                _select_tile(
                    energies_b, keep_bits_ptr + segment_b.to(tl.int64) * bits_stride, counts_ptr, segment_b, max_b,
                    alpha, visible_b, candidates_b, diagonal_b, dense_b, sink_blocks, window_lo_b, window_hi_b, CHUNK,
                    PASS2, WORD,
                )  # fmt: skip
        # The next unit overwrites this program's energies rows.
        tl.debug_barrier()
        if SNAKE:  # round r = units r P .. r P + P - 1: program p takes the p-th from the heavy end in even rounds,
            # from the light end in odd ones
            next_round = work // num_programs + 1
            work = next_round * num_programs + tl.where(next_round % 2 == 0, pid, num_programs - 1 - pid)
        else:
            work += num_programs

    # ---- the last program to finish writes offsets[1:] = cumsum(counts) (ordering: see the module docstring)
    tl.debug_barrier()  # this program's count stores come before its increment
    finished = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")  # earlier increments
    if finished == num_programs - 1:
        tl.debug_barrier()
        scan_counts(counts_ptr, offsets_ptr, num_segments, zero, SCAN)
        tl.store(done_ptr, zero)  # every program has counted: ready for the next call


#: Counts the last program sums per step of the offsets scan.
SCAN_COUNTS = 4096

#: Launcher of the fused kernel (direct relaunch of the compiled kernel, :mod:`.launcher`).
_SCORE_SELECT = Relauncher(_score_select_kernel)


def num_units(tiles_per_request: list[int], tiles_per_program: int) -> int:
    """Units of work per KV head: each request's tiles in groups of ``tiles_per_program`` (the last may be short).

    Args:
        tiles_per_request: query tiles of each request.
        tiles_per_program: 1 or 2.

    Returns:
        ``sum(ceil(n / tiles_per_program))``.
    """
    return sum(-(-n // tiles_per_program) for n in tiles_per_request)


def launch_score_select(
    q: torch.Tensor,
    keys: torch.Tensor,
    *,
    q_descale: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_offsets: torch.Tensor,
    tile_offsets: torch.Tensor,
    offsets: torch.Tensor,
    views: WorkspaceViews,
    total_units: int,
    num_programs: int,
    group: int,
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
    knobs: tuning.ScoreTuning | None = None,
) -> None:
    """Run the fused scoring/selection kernel (inputs checked by the caller).

    Writes ``views.keep_bits`` (the rows of every segment, whole 64-block chunks
    up to the tile's visible blocks), ``views.counts``, ``tile_offsets`` and all of
    ``offsets`` (``[0, cumsum(counts)]``, by the last program to finish; ``views.done``
    must read 0 on entry and reads 0 again on exit).

    Args:
        q: ``(total_q, Hq, d)`` queries, unit stride in ``d``.
        keys: ``(total_blocks, Hkv, d)`` contiguous pooled keys from :func:`launch_prepare_keys`
            (prescaled to log2 units, in the dot dtype of ``dot_kind``).
        q_descale: ``(B, Hkv) float32`` contiguous, or None.
        cu_seqlens_q: ``(B+1,) int32`` query offsets.
        seqlens_k: ``(B,) int32`` KV lengths.
        block_offsets: ``(B+1,) int32`` cumulative key blocks per request.
        tile_offsets: ``(B+1,) int32`` output: cumulative tiles per request.
        offsets: ``(S+1,) int32`` output: the CSR offsets.
        views: workspace views of the call, with ``tiles_per_program`` energies rows per program.
        total_units: units of work per KV head (:func:`num_units` of the knobs' ``tiles_per_program``).
        num_programs: persistent grid size.
        group: GQA group size ``g``.
        alpha: threshold ratio.
        tile_size: packed rows per tile.
        block_size: tokens per key block.
        probe_stride: score every ``probe_stride``-th row of a tile.
        sink_tokens: leading tokens always kept.
        window_tokens: tokens before the tile always kept.
        dense_tail_tiles: last tiles of a request kept dense.
        min_sparse_kv_len: requests shorter than this are kept dense.
        dot_kind: :data:`DOT_FP32`, :data:`DOT_FP16` or :data:`DOT_BF16`.
        interpret: running under the Triton interpreter (pass-1 loops as ``while``, plain energy stores).
        knobs: scoring knobs (None: :data:`.tuning.SCORE`); the caller sized the work and the workspace
            with the same ones.
    """
    num_kv_heads, head_dim = keys.shape[1], keys.shape[2]
    if total_units * num_kv_heads == 0:
        return
    knobs = tuning.SCORE if knobs is None else knobs
    rows = score_rows(tile_size, probe_stride)
    launch = {"num_warps": knobs.num_warps, "num_stages": knobs.stages_for(head_dim, rows)}
    maxnreg = knobs.maxnreg_for(head_dim, rows)
    if maxnreg is not None and not interpret:
        launch["maxnreg"] = maxnreg
    if views.energies.shape[0] < num_programs * knobs.tiles_per_program:
        raise ValueError(
            f"the workspace holds {views.energies.shape[0]} energies rows, {num_programs} programs of "
            f"{knobs.tiles_per_program} tiles need {num_programs * knobs.tiles_per_program}"
        )
    block_d = max(16, next_power_of_2(head_dim))
    num_requests = cu_seqlens_q.numel() - 1
    _SCORE_SELECT(
        (num_programs,),
        q,
        keys,
        q_descale if q_descale is not None else views.energies,
        cu_seqlens_q,
        seqlens_k,
        block_offsets,
        tile_offsets,
        offsets,
        views.energies,
        views.keep_bits,
        views.counts,
        views.done,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        num_requests,
        total_units,
        num_kv_heads,
        group,
        head_dim,
        views.energies.stride(0),
        views.keep_bits.stride(0),
        float(alpha),
        -(-sink_tokens // block_size),
        window_tokens,
        dense_tail_tiles,
        min_sparse_kv_len,
        views.counts.numel(),
        TILE=tile_size,
        BLOCK_SIZE=block_size,
        PROBE=probe_stride,
        ROWS=rows,
        FULL_ROWS=rows * probe_stride == tile_size,
        BLOCK_N=knobs.block_n,
        BLOCK_D=block_d,
        EVEN_D=block_d == head_dim,
        BLOCK_B=max(2, next_power_of_2(num_requests)),
        CHUNK=CHUNK_BLOCKS,
        PASS2=pass2_blocks(views.energies.shape[1]),
        WORD=WORD_BITS,
        DOT_KIND=dot_kind,
        HAS_Q_DESCALE=q_descale is not None,
        USE_WHILE=interpret,
        FAST_LOG2=not interpret,
        TILES=knobs.tiles_per_program,
        MMA_STORE=knobs.mma_store and not interpret,
        SCAN=SCAN_COUNTS,
        TREE_MAX=knobs.tree_max,
        POLY=knobs.poly_exp2,
        LIGHT_TAIL=knobs.light_tail,
        SNAKE=knobs.snake_order,
        PREFETCH=knobs.key_prefetch and knobs.tiles_per_program == 1,
        GROUP=group if knobs.const_group else 0,
        Q_PREFETCH=-(-head_dim * q.element_size() // 128) if knobs.q_prefetch and not interpret else 0,
        **launch,
    )
