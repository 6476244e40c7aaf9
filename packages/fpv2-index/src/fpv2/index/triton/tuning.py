"""Launch knobs of the Triton index kernels, in one place so benchmarks can sweep them.

The defaults are the measured best on an H200 for the standard shapes
(one 128K request, 32/8 heads, d 128, bf16, page size 1), from the sweep of
``benchmarks/index_speed.py --sweep --auto-tune`` in
``benchmarks/results/2026-11-29-h200-index-speed/`` (see ``benchmarks/NOTES.md``,
index stage): scoring with three programs per SM at a 168-register cap (2.36 ms
against 2.55 ms for two uncapped programs), pooling 8 tokens x all 8 heads per
program (0.18 ms against 0.30 ms for one head).
Changing a field changes the compiled variant, never the result (up to the
near-threshold rounding of a different chunking).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ScoreTuning:
    """Knobs of the fused scoring/selection kernel.

    Attributes:
        block_n: pooled keys per scoring step (the MMA's M; 64 or 128).
        num_warps: warps per program (4 = one warpgroup; 8 pairs with ``block_n = 128``).
        num_stages: software-pipeline depth of the pooled-key loads.
        programs_per_sm: persistent programs per streaming multiprocessor for full 128-row tiles.
            The kernel needs about 230 registers per thread there (two 4-warp programs per SM);
            with ``maxnreg = 168`` three fit, spilling only outside the scoring loop.
        maxnreg: register cap per thread passed to the compiler (None: the compiler's choice).
        probe_programs_per_sm: persistent programs per SM when probing leaves 64 rows (167
            registers) and 32 or fewer rows (about 120 registers).
        tiles_per_program: query tiles a program scores together (1 or 2). With 2, the two
            adjacent tiles of a (request, KV head) walk each pooled-key chunk once: one load, one
            ``cp.async`` wait and its barriers per chunk for both tiles' GEMMs and exponentials (two
            independent chains for the scheduler), half the L2 key traffic. Same index as 1.
            Measured slower on the H200 at 128K (2.57 against 2.41 ms: two programs per SM instead
            of three), so 1 stays the default (benchmarks/NOTES.md, 2026-12-01).
        pair_programs_per_sm: persistent programs per SM with two full 128-row tiles per program:
            two query tiles (64 KB of shared memory) and the key stages (16 KB each), so two fit.
        pair_maxnreg: register cap with two tiles per program (None: the compiler's choice; two
            4-warp programs per SM leave 255 registers per thread).
        pair_num_stages: pooled-key pipeline depth with two full tiles per program (``d <= 128``).
            With 2 stages Triton issues a step's key load at the end of the step before and waits
            for it at the top of the step (the L2 latency is exposed every step); 3 stages wait one
            step later. Two programs of 2 x 32 KB queries + 3 x 16 KB keys (plus 1 KB reserved
            each) fill the 228 KB of an SM exactly.
        mma_store: store each step's block energies straight from the MMA accumulator's layout
            (one ``st.global`` per held value, the 4 lanes holding a value write the same word)
            instead of through a shared-memory layout change and a CTA barrier. CUDA only; the
            interpreter always takes the plain store. Measured 2.20 against 2.41 ms at 128K in one
            run, inside the default's run-to-run spread; off until confirmed.
        tree_max: take each block's maximum over the tile's rows as a pairwise tree in registers (column ``j``
            against ``j + R/2``, then ``j + R/4``, ...) instead of Triton's in-thread chain: for 128 rows the
            dependent chain per block goes from 31 ``FMNMX`` (plus two shuffles) to 5 (plus the same two);
            same instruction count, same values (a maximum does not depend on the order).
        light_tail: in the steps after the unmasked ones (the last one or two of a tile), mask by block id
            only, on the 64 per-block results, when every probed row sees every candidate of the tile (full
            tiles whose positions do not cross a block start: always the case for 128 rows of ``g = 4`` at
            ``Bk = 128``); otherwise mask per logit as before. Same values. Such a step is the unmasked step
            plus a masked load and store (about 440 instead of 963 SASS instructions per warp at 128 rows, no
            spill reloads), and it is one step in 2.5 at 32K, one in 8.5 at 128K.
        snake_order: hand out the units (heaviest first) in rounds of ``P``, program ``p`` taking the ``p``-th
            of a round from the heavy end in even rounds and from the light end in odd ones (boustrophedon),
            instead of the ``p``-th in every round: with the plain order program 0 gets the heaviest unit of
            every round and finishes last (about 16 steps of work more than the last program at 128K, 4 at
            32K). Same index.
        key_prefetch: load each step's pooled keys into registers one step ahead (and the first step's
            before the query rows), instead of Triton's two-stage ``cp.async`` pipeline, which issues the
            load of step ``i + 1`` at the end of step ``i`` and waits for it at the top of step ``i + 1``:
            the L2 latency is then hidden behind a whole step. Costs 32 registers per thread for the keys
            in flight and a register-to-shared copy of the keys per step (one more CTA barrier). One tile
            per program only (ignored with ``tiles_per_program = 2``). Same index.
        prefetch_max_blocks: turn ``key_prefetch`` on for a call whose longest request has at most this
            many key blocks and whose tiles score every row (0: never; see :meth:`for_call`). On the H200
            the prefetch wins while tiles walk few steps and loses once they walk many: 0.171 against
            0.199 ms at 32K (256 blocks), 0.495 against 0.534 ms at 64K (512), 1.665 against 1.592 ms at
            128K (1024), same index (``results/2026-12-01-h200-index-prefetch-crossover``).
        poly_exp2: compute part of each step's exponentials with a degree-5 polynomial on the FMA pipe
            instead of ``MUFU.EX2`` (0: none; 1: a quarter of the columns, for tiles of 32 or more scored
            rows; 2: half, 16 or more): a warp's 64 ``MUFU.EX2`` per step issue once per 8 cycles (the
            SFU takes 16 results per clock per SM), 512 cycles of the step's serial chain; a quarter on the
            FMA pipe leaves 384, the polynomial's 10 instructions per value filling issue slots the MUFU
            stream leaves free. Not bit-identical: energies move by about 1e-7 relative (another exponential,
            another summation order), so blocks within that of the threshold may flip.
        const_group: compile the GQA group size ``g`` into the kernel (one compiled kernel per ``g``): the
            PackGQA gather of a tile's query rows (``row // g``, ``row % g`` for the 16 rows a thread loads)
            and the tile geometry then need no integer divisions (signed division sequences, some 60
            ``IABS`` per unit at ``g = 4``): a unit's instructions outside its steps go from about 1,800 to
            1,000 at 32K (2,000 to 1,140 at 128K) and its spill stack from 192 to 0-8 bytes. Same index.
        q_prefetch: at the start of a unit, prefetch the query rows of the program's next unit into L2
            (``prefetch.global.L2``, two 128-byte lines per row and thread at ``d = 128``): a unit's query
            load (32 KB per 128-row tile, one pass over Q in all) otherwise waits for HBM, once per unit,
            before its first GEMM. CUDA only (the interpreter skips it). Same index.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 3
    maxnreg: int | None = 168
    probe_programs_per_sm: tuple[int, int] = (3, 4)
    tiles_per_program: int = 1
    pair_programs_per_sm: int = 2
    pair_maxnreg: int | None = None
    pair_num_stages: int = 3
    mma_store: bool = False
    tree_max: bool = False
    light_tail: bool = False
    snake_order: bool = False
    key_prefetch: bool = False
    poly_exp2: int = 0
    const_group: bool = False
    q_prefetch: bool = False
    prefetch_max_blocks: int = 0

    def for_call(self, max_blocks: int, rows: int, tile_size: int, head_dim: int = 128) -> ScoreTuning:
        """The knobs one call launches with: these, with ``key_prefetch`` on when the call is short enough, and
        the wide-head tile shape at ``d > 128``.

        Args:
            max_blocks: key blocks of the call's longest request.
            rows: scored rows per tile after probing.
            tile_size: packed rows per tile (``rows < tile_size`` means probing, which was not measured).
            head_dim: ``d`` of the call.

        Returns:
            ``self``; or, at ``d > 128`` for the default shape (64 keys a step, 4 warps, one tile a program,
            every row scored, no forced prefetch), a copy with 128 keys a step on 8 warps and no prefetch
            (H200, d = 256, planted, page 1, ``results/2026-12-01-h200-index-d256-sweep``: index 0.693 -> 0.640 ms
            at 32K, 1.648 -> 1.460 ms at 64K, 4.763 -> 4.182 ms at 128K, 0 (segment, block) pairs differing);
            else a copy with ``key_prefetch=True`` when ``max_blocks <= prefetch_max_blocks``, every row is
            scored and one tile runs per program.
        """
        if head_dim > 128:
            default_shape = self.block_n == 64 and self.num_warps == 4 and not self.key_prefetch
            if default_shape and self.tiles_per_program == 1 and rows >= tile_size:
                return _with_wide_head_tiles(self)
            return self
        if (
            self.key_prefetch
            or self.tiles_per_program != 1
            or rows < tile_size
            or not 0 < max_blocks <= self.prefetch_max_blocks
        ):
            return self
        return _with_key_prefetch(self)

    def programs_for(self, rows: int, head_dim: int = 128) -> int:
        """Persistent programs per SM for tiles of ``rows`` scored rows (padded to a power of two).

        Args:
            rows: scored rows per tile after probing.
            head_dim: ``d``; with ``d > 128`` the query tile and the key stages need twice the shared
                memory, so one program per SM for full tiles and half the probe counts.

        Returns:
            Programs per SM.
        """
        if self.tiles_per_program == 2:
            if rows >= 128:
                return self.pair_programs_per_sm if head_dim <= 128 else 1
            # Two probed tiles take the registers of one full tile or more (168, the cap, for 2 x 16 rows
            # too: four such programs would not fit the 64K registers of an SM), and at most its shared memory.
            count = self.probe_programs_per_sm[0]
            return count if head_dim <= 128 else max(1, count // 2)
        if rows >= 128:
            count = self.programs_per_sm
        else:
            count = self.probe_programs_per_sm[0] if rows >= 64 else self.probe_programs_per_sm[1]
        if head_dim > 128:
            count = 1 if rows >= 128 else max(1, count // 2)
        return count

    def stages_for(self, head_dim: int, rows: int = 128) -> int:
        """The pooled-key pipeline depth to compile with.

        Args:
            head_dim: ``d``.
            rows: scored rows per tile after probing.

        Returns:
            :attr:`pair_num_stages` for two full tiles per program with ``d <= 128``, else :attr:`num_stages`
            (two probed tiles then take the shared memory of one full tile, as :meth:`programs_for` assumes).
        """
        if self.tiles_per_program == 2 and rows >= 128 and head_dim <= 128:
            return self.pair_num_stages
        return self.num_stages

    def maxnreg_for(self, head_dim: int, rows: int = 128) -> int | None:
        """The register cap to compile with, None for ``d > 128`` (only ``d <= 128`` was measured).

        Args:
            head_dim: ``d``.
            rows: scored rows per tile after probing.

        Returns:
            :attr:`pair_maxnreg` for two full tiles per program, else :attr:`maxnreg`; None for ``d > 128``.
        """
        if head_dim > 128:
            return None
        return self.pair_maxnreg if self.tiles_per_program == 2 and rows >= 128 else self.maxnreg


@functools.lru_cache(maxsize=16)
def _with_wide_head_tiles(knobs: ScoreTuning) -> ScoreTuning:
    """``knobs`` with the ``d > 128`` tile shape (128 keys a step, 8 warps), built once per knob set."""
    return replace(knobs, block_n=128, num_warps=8)


@functools.lru_cache(maxsize=16)
def _with_key_prefetch(knobs: ScoreTuning) -> ScoreTuning:
    """``knobs`` with ``key_prefetch`` on, built once per knob set (``for_call`` runs on every index call)."""
    return replace(knobs, key_prefetch=True)


@dataclass(frozen=True)
class PoolTuning:
    """Knobs of the pooling kernel.

    Attributes:
        tokens: tokens loaded per step (capped by the block size) when a step's tokens share pages.
        num_warps: warps per program.
        heads: KV heads pooled per program (a power of two): with all heads of a token in one
            program, each token's K (and V) row is one contiguous read.
        gather_tokens: tokens per step when the pages are smaller than ``tokens`` (every token of a step
            a page-table gather, page size 1 above all). H200, B=1, 32/8 heads, d = 128, planted
            (``results/2026-12-02-h200-index-pool-knobs/``): at page 1 the pooling kernel (CUDA-graph
            replay) ran 0.082 -> 0.057 ms at 32K and 0.142 -> 0.136 ms at 128K with 4 tokens a step
            instead of 8, while at page 128 4 tokens were slower (0.044 -> 0.063 ms at 32K).
    """

    tokens: int = 8
    num_warps: int = 4
    heads: int = 8
    gather_tokens: int = 4

    def tokens_for(self, page_size: int, block_size: int) -> int:
        """Tokens per step for a cache of ``page_size``: :attr:`gather_tokens` when a step of :attr:`tokens`
        would span several pages, else :attr:`tokens`; at most ``block_size``.

        Args:
            page_size: tokens per page.
            block_size: tokens per key block.

        Returns:
            A power of two >= 1.
        """
        return min(self.gather_tokens if page_size < self.tokens else self.tokens, block_size)

    def heads_for(self, num_kv_heads: int, block_d: int) -> int:
        """Heads per program for a cache of ``num_kv_heads`` heads of ``block_d`` (padded) dims: :attr:`heads`,
        at most the heads there are and at most 1024 columns per program (register budget).

        Args:
            num_kv_heads: ``Hkv``.
            block_d: head dimension padded to a power of two.

        Returns:
            A power of two >= 1.
        """
        return max(1, min(self.heads, next_power_of_2(num_kv_heads), 1024 // block_d))


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``); plain Python, cheap on the launch path."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


#: The package default: the bit-identical scoring variants together ("exact" of
#: ``benchmarks/index_scoring_sweep.py``). H200, B=1, Hq/Hkv = 32/8, d = 128, planted, page 1
#: (``results/2026-12-01-h200-index-scoring-sweep``): scoring kernel 1.929 -> 1.592 ms at 128K and
#: 0.281 -> 0.198 ms at 32K, index call 2.24 -> 1.85 ms and 0.67 -> 0.40 ms, 0 (segment, block) pairs
#: differing. ``key_prefetch`` on top helps 32K (0.171 ms) and 64K and hurts 128K (1.665 ms): on for calls
#: of at most 512 key blocks (``prefetch_max_blocks``).
SCORE = ScoreTuning(
    mma_store=True, tree_max=True, light_tail=True, snake_order=True, const_group=True, prefetch_max_blocks=512
)
POOL = PoolTuning()


def set_tuning(*, score: ScoreTuning | None = None, pool: PoolTuning | None = None) -> tuple[ScoreTuning, PoolTuning]:
    """Replace the launch knobs (process-wide); returns the previous ones so a caller can restore them.

    Args:
        score: new scoring knobs, or None to keep them.
        pool: new pooling knobs, or None to keep them.

    Returns:
        ``(previous score knobs, previous pool knobs)``.

    Raises:
        ValueError: a knob is out of range.
    """
    global SCORE, POOL
    previous = (SCORE, POOL)
    if score is not None:
        if score.block_n not in (64, 128) or score.num_warps not in (4, 8) or score.num_stages < 1:
            raise ValueError(f"unsupported scoring knobs {score}")
        if min(score.programs_per_sm, *score.probe_programs_per_sm) < 1:
            raise ValueError(f"programs per SM must be >= 1, got {score}")
        for cap in (score.maxnreg, score.pair_maxnreg):
            if cap is not None and not 64 <= cap <= 255:
                raise ValueError(f"maxnreg must lie in 64..255, got {cap} ({score})")
        if score.tiles_per_program not in (1, 2) or score.pair_programs_per_sm < 1 or score.pair_num_stages < 1:
            raise ValueError(
                f"tiles_per_program must be 1 or 2, pair_programs_per_sm and pair_num_stages >= 1, got {score}"
            )
        if score.prefetch_max_blocks < 0:
            raise ValueError(f"prefetch_max_blocks must be >= 0, got {score}")
        if score.poly_exp2 not in (0, 1, 2):
            raise ValueError(f"poly_exp2 must be 0, 1 or 2, got {score}")
        SCORE = replace(score)
    if pool is not None:
        powers = (1, 2, 4, 8, 16)
        bad_tokens = any(t < 1 or t & (t - 1) for t in (pool.tokens, pool.gather_tokens))
        if bad_tokens or pool.num_warps not in powers[:4] or pool.heads not in powers:
            raise ValueError(f"unsupported pooling knobs {pool}")
        POOL = replace(pool)
    return previous
