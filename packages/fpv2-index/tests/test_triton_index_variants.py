"""Scoring-kernel variants (``fpv2.index.triton.tuning.ScoreTuning`` knobs) against the default and the reference.

Knobs that only change how the kernel computes (``tree_max``, ``light_tail``,
``snake_order``, ``key_prefetch``, ``const_group``; ``mma_store`` and
``q_prefetch``, which the interpreter skips, on CUDA) must give the
*identical* CSR (offsets and blocks) and identical workspace energies;
``poly_exp2`` changes the rounding of the energies (a polynomial for part of the
exponentials, another summation order), so its CSR may differ from the
default's only at blocks whose reference energy ratio lies within ``NEAR`` of
``alpha`` (counted), and it must match the reference like the default does.

Every case checks that it reaches the code a variant changes: tiles with a
tail step masked by block id only (``light_tail``), tiles whose rows do not
all see their candidates (the per-logit masks stay), unmasked steps, more
units than programs (``snake_order``), probing.

CPU runs use the Triton interpreter (``TRITON_INTERPRET=1``) on fp16/fp32
inputs; ``gpu`` tests repeat the identity on CUDA with bf16.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

# The Triton index tests' skip rules and helpers (pytest applies the imported ``pytestmark``).
from test_triton_index import (  # noqa: E402, F401
    DEVICE,
    _compare,
    _reference_ratios,
    _small_config,
    needs_cuda,
    pytestmark,
)
from test_triton_index_pairs import _assert_identical  # noqa: E402

from fpv2.index.config import SelectionConfig  # noqa: E402
from fpv2.index.reference import select_blocks  # noqa: E402
from fpv2.index.triton import IndexWorkspace, pool_blocks_triton, scoring, select_blocks_triton, tuning  # noqa: E402
from fpv2.index.triton.tuning import ScoreTuning, set_tuning  # noqa: E402
from fpv2.kernel.contracts import num_query_tiles, tile_span  # noqa: E402
from fpv2.kernel.reference.pooling import pool_blocks  # noqa: E402
from fpv2.kernel.testing import planted_workload  # noqa: E402

gpu = pytest.mark.gpu

#: (label, knob overrides, bit-identical to the default).
EXACT = {"tree_max": True, "light_tail": True, "snake_order": True, "const_group": True}
VARIANTS = [
    ("tree_max", {"tree_max": True}, True),
    ("light_tail", {"light_tail": True}, True),
    ("snake_order", {"snake_order": True}, True),
    ("key_prefetch", {"key_prefetch": True}, True),
    ("const_group", {"const_group": True}, True),
    ("poly_exp2=1", {"poly_exp2": 1}, False),
    ("poly_exp2=2", {"poly_exp2": 2}, False),
    ("combined", {**EXACT, "key_prefetch": True, "q_prefetch": True}, True),
    ("combined+poly", {**EXACT, "poly_exp2": 1}, False),
]
VARIANT_PARAMS = [pytest.param(overrides, exact, id=label) for label, overrides, exact in VARIANTS]
#: Knobs whose code only CUDA runs (the interpreter takes the plain store and skips the prefetch): GPU tests only.
CUDA_ONLY_PARAMS = [
    pytest.param({"mma_store": True}, True, id="mma_store"),
    pytest.param({"q_prefetch": True}, True, id="q_prefetch"),
    pytest.param({**EXACT, "mma_store": True, "key_prefetch": True, "q_prefetch": True}, True, id="all-exact"),
]


#: Every variant knob off: the plain kernel each variant is compared with (the package default turns the
#: exact ones on, which would make a knob's comparison with the default compare it with itself).
PLAIN = {
    "mma_store": False,
    "light_tail": False,
    "tree_max": False,
    "snake_order": False,
    "const_group": False,
    "prefetch_max_blocks": 0,  # the default turns the key prefetch on for short calls: off in the baseline
}


def _select_variant(overrides: dict, q, batch, stats, config: SelectionConfig, **kwargs):
    """``select_blocks_triton`` with the plain knobs plus ``overrides`` (restored afterwards), exact ``nnz``."""
    previous = set_tuning(score=replace(tuning.SCORE, **{**PLAIN, **overrides}))
    try:
        return select_blocks_triton(q, batch, stats, config=config, exact_nnz=True, **kwargs)
    finally:
        set_tuning(score=previous[0])


def _tail_kinds(batch, group: int, config: SelectionConfig, block_n: int) -> tuple[int, int, int]:
    """``(unmasked steps, tiles with a tail step every row sees, tiles with a per-logit masked tail)`` of a batch.

    From host geometry, as the kernel decides: a tile's first ``floor(full / block_n)`` steps are unmasked
    (``full`` = blocks every probed row sees, full tiles with whole probe rows only); it is *light* when
    ``full`` covers all its candidates, and then its remaining step (if any) masks by block id only.
    """
    host = batch.host
    rows = scoring.score_rows(config.tile_size, config.probe_stride)
    full_rows = rows * config.probe_stride == config.tile_size
    unmasked = light = heavy = 0
    for q_len, prefix, kv_len in zip(host.q_lens, host.prefix, host.seqlens_k):
        n = num_query_tiles(q_len, group, config.tile_size)
        for t in range(n):
            if t >= n - config.dense_tail_tiles or kv_len < config.min_sparse_kv_len:
                continue
            span = tile_span(t, q_len, prefix, group, tile_size=config.tile_size, block_size=config.block_size)
            candidates = span.num_scored_blocks
            first = prefix + t * config.tile_size // group
            whole = full_rows and min((t + 1) * config.tile_size, q_len * group) - t * config.tile_size == (
                config.tile_size
            )
            full = min(first // config.block_size + 1, candidates) if whole else 0
            unmasked += full // block_n
            if candidates > full // block_n * block_n:
                if full == candidates:
                    light += 1
                else:
                    heavy += 1
    return unmasked, light, heavy


# (Hq, Hkv, page size, q lens, kv lens, tile, probe, dtype, tail kinds the case must have). Long prefixes: several
# 64-block steps per tile. Kinds (see _tail_kinds): "unmasked" steps, "light" tails, "heavy" (per-logit masked) tails.
CASES = [
    # g = 4: 16 positions per 64-row tile, 16-token blocks: every full tile is light (the partial last ones not).
    pytest.param(8, 2, 16, [40, 33], [1400, 700], 64, 1, torch.float16, {"unmasked", "light", "heavy"}, id="light-g4"),
    # 32 positions per 64-row tile: tails whose first rows do not see the last candidate; probe 2.
    pytest.param(
        4, 2, 1, [70, 45, 9], [1700, 1300, 400], 64, 2, torch.float32, {"unmasked", "heavy"}, id="rows-cross-probe2"
    ),
    # A probe of 3 pads the probed rows: no unmasked steps and no light tails at all.
    pytest.param(4, 2, 16, [70, 40], [2300, 1500], 32, 3, torch.float16, {"heavy"}, id="probe3"),
]


_CASE_CACHE: dict[tuple, tuple] = {}


def _case(hq, hkv, page_size, q_lens, kv_lens, tile, probe, dtype) -> tuple:
    """Workload, statistics, config, the default kernel's index, reference ratios and index of a case (cached:
    every variant is compared with the same default)."""
    key = (hq, hkv, page_size, tuple(q_lens), tuple(kv_lens), tile, probe, dtype)
    if key not in _CASE_CACHE:
        w = planted_workload(
            q_lens,
            kv_lens,
            num_q_heads=hq,
            num_kv_heads=hkv,
            head_dim=64,
            page_size=page_size,
            block_size=16,
            fraction=0.2,
            margin=2.0,
            dtype=dtype,
            device=DEVICE,
            seed=hq * 5 + tile + probe,
        )
        config = _small_config(tile_size=tile, probe_stride=probe, dense_tail_tiles=0)
        stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
        default = _select_variant({}, w.q, w.batch, stats, config, workspace=IndexWorkspace(max_programs=3))
        ratios = _reference_ratios(w.q, w.batch, stats, config)
        ref = select_blocks(w.q, w.batch, stats, config=config)
        _CASE_CACHE[key] = (w, stats, config, default, ratios, ref)
    return _CASE_CACHE[key]


@pytest.mark.parametrize(("hq", "hkv", "page_size", "q_lens", "kv_lens", "tile", "probe", "dtype", "kinds"), CASES)
@pytest.mark.parametrize(("overrides", "exact"), VARIANT_PARAMS)
def test_variant_gives_the_default_csr(
    overrides, exact, hq, hkv, page_size, q_lens, kv_lens, tile, probe, dtype, kinds, record_property
) -> None:
    w, stats, config, default, ratios, ref = _case(hq, hkv, page_size, q_lens, kv_lens, tile, probe, dtype)
    got = _select_variant(overrides, w.q, w.batch, stats, config, workspace=IndexWorkspace(max_programs=3))
    if exact:
        _assert_identical(got, default)
    else:  # only near-threshold flips against the default, and against the reference
        flips_vs_default, _ = _compare(got, default, ratios, config.alpha)
        record_property("flips_vs_default", flips_vs_default)
    flips, scored = _compare(got, ref, ratios, config.alpha)
    assert flips <= max(1, scored // 100)
    # The case reaches the code the variants change, and several rounds of the 3 programs (snake order).
    counts = dict(zip(("unmasked", "light", "heavy"), _tail_kinds(w.batch, hq // hkv, config, tuning.SCORE.block_n)))
    assert {kind for kind, n in counts.items() if n} == kinds, counts
    assert hkv * sum(num_query_tiles(n, hq // hkv, tile) for n in q_lens) > 2 * 3


@pytest.mark.parametrize(("overrides", "exact"), VARIANT_PARAMS)
@pytest.mark.parametrize("q_len", [16, 32], ids=["light", "rows-cross-blocks"])
def test_variant_energies_equal_the_default(overrides, exact, q_len: int) -> None:
    # One segment (one request, one KV head, one 32- or 64-row tile of 16 or 32 positions x 2 heads) on one
    # program: its workspace row ends up holding the segment's log2 energies. 1200 tokens, 16-token blocks:
    # 74 or 75 candidates, one unmasked 64-block step and one tail step (light for 16 positions).
    w = planted_workload(
        [q_len], [1200], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32,
        device=DEVICE, seed=q_len,
    )  # fmt: skip
    config = _small_config(tile_size=2 * q_len, dense_tail_tiles=0)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    rows = []
    for knobs in ({}, overrides):
        ws = IndexWorkspace(max_programs=1)
        _select_variant(knobs, w.q, w.batch, stats, config, workspace=ws)
        views = ws.reserve(num_programs=1, max_blocks=75, num_segments=1, device=torch.device(DEVICE))
        rows.append(views.energies[0].clone())
    unmasked, light, heavy = _tail_kinds(w.batch, 2, config, tuning.SCORE.block_n)
    assert (unmasked, light, heavy) == ((1, 1, 0) if q_len == 16 else (1, 0, 1))
    default, got = rows[0][: 1200 // 16], rows[1][: 1200 // 16]  # the 75 candidates (the last row's position 1199)
    assert torch.isfinite(default).all()
    if exact:
        assert torch.equal(got, default)
    else:
        torch.testing.assert_close(got, default, rtol=1e-6, atol=1e-5)  # log2 units: 1e-6 relative energy


@triton.jit
def _exp2_probe_kernel(x_ptr, exp_ptr, max_ptr, sums_ptr, N: tl.constexpr, R: tl.constexpr):
    i = tl.arange(0, N)
    r = tl.arange(0, R)
    x = tl.load(x_ptr + i[:, None] * R + r[None, :])
    tl.store(exp_ptr + i[:, None] * R + r[None, :], scoring._exp2_poly(x))
    tl.store(max_ptr + i, scoring._tree_max(x, R, N))
    for poly in tl.static_range(3):
        tl.store(sums_ptr + poly * N + i, scoring._exp2_sum(x, R, N, poly))


@pytest.mark.parametrize("rows", [16, 32, 128])
def test_polynomial_exp2_tree_max_and_split_sums(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = -torch.rand(64, rows, generator=gen) * 140
    x[0] = torch.linspace(-2, 0, rows)  # near 0: the largest terms
    x[1] = -torch.arange(rows, dtype=torch.float32) * 0.37  # a spread of fractional parts
    x = x.to(DEVICE)
    exp = torch.empty_like(x)
    maxima = torch.empty(64, device=DEVICE)
    sums = torch.empty(3, 64, device=DEVICE)
    _exp2_probe_kernel[(1,)](x, exp, maxima, sums, N=64, R=rows)
    x, exp, maxima, sums = x.cpu().double(), exp.cpu().double(), maxima.cpu(), sums.cpu().double()
    ref = torch.exp2(x)
    normal = x >= -120
    assert (exp[normal] / ref[normal] - 1).abs().max() < 3e-7
    assert (exp[~normal] / 2.0**-120 - 1).abs().max() < 3e-7  # clamped: invisible next to a block's largest term
    assert torch.equal(maxima, x.float().max(dim=1).values)  # bit-identical
    for poly in range(3):
        assert ((sums[poly] / ref.sum(dim=1)) - 1).abs().max() < 1e-6, poly


def test_snake_order_writes_every_segment() -> None:
    # Fresh, poisoned scratch: a unit the zigzag skipped would leave -1 counts (wrong offsets) and garbage bits.
    w = planted_workload(
        [50, 21, 64, 7], [400, 21, 200, 90], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
        block_size=16, fraction=0.25, margin=1.0, dtype=torch.float16, device=DEVICE, seed=9,
    )  # fmt: skip
    config = _small_config(tile_size=32)
    stats = pool_blocks_triton(w.k_cache, None, w.batch, block_size=16)
    default = _select_variant({}, w.q, w.batch, stats, config, workspace=IndexWorkspace(max_programs=4))
    for programs in (1, 3, 7):
        ws = IndexWorkspace(max_programs=programs)
        nb = max(-(-k // 16) for k in w.batch.host.seqlens_k)
        views = ws.reserve(
            num_programs=min(programs, default.num_segments), max_blocks=nb, num_segments=default.num_segments,
            device=torch.device(DEVICE),
        )  # fmt: skip
        views.keep_bits.fill_(-1)
        views.counts.fill_(-1)
        got = _select_variant({"snake_order": True}, w.q, w.batch, stats, config, workspace=ws)
        _assert_identical(got, default)


def test_variant_knobs_are_checked_and_the_default_is_the_measured_exact_set() -> None:
    knobs = ScoreTuning()
    flags = ("tree_max", "light_tail", "snake_order", "key_prefetch", "const_group", "q_prefetch")
    assert not any(getattr(knobs, name) for name in flags) and knobs.poly_exp2 == 0
    with pytest.raises(ValueError, match="poly_exp2"):
        set_tuning(score=ScoreTuning(poly_exp2=3))
    # The package default: the bit-identical knobs that measured faster together on the H200, nothing else.
    assert all(getattr(tuning.SCORE, name) for name in PLAIN if name != "prefetch_max_blocks")
    assert not tuning.SCORE.key_prefetch and not tuning.SCORE.q_prefetch and tuning.SCORE.poly_exp2 == 0
    # ... and the key prefetch for calls of at most 512 key blocks (64K tokens), where it measured faster.
    assert tuning.SCORE.prefetch_max_blocks == 512
    with pytest.raises(ValueError, match="prefetch_max_blocks"):
        set_tuning(score=ScoreTuning(prefetch_max_blocks=-1))


@pytest.mark.parametrize(
    ("knobs", "max_blocks", "rows", "prefetch"),
    [
        (ScoreTuning(prefetch_max_blocks=512), 256, 128, True),
        (ScoreTuning(prefetch_max_blocks=512), 512, 128, True),
        (ScoreTuning(prefetch_max_blocks=512), 513, 128, False),  # 128K-class calls keep the two-stage loads
        (ScoreTuning(prefetch_max_blocks=512), 0, 128, False),  # no key blocks: nothing to prefetch
        (ScoreTuning(prefetch_max_blocks=512), 256, 64, False),  # probing: not measured, left as it was
        (ScoreTuning(prefetch_max_blocks=512, tiles_per_program=2), 256, 128, False),  # the pair walk has none
        (ScoreTuning(prefetch_max_blocks=0), 256, 128, False),
        (ScoreTuning(key_prefetch=True), 4096, 128, True),  # forced on stays on
    ],
)
def test_key_prefetch_is_chosen_per_call_by_the_longest_request(knobs, max_blocks, rows, prefetch) -> None:
    chosen = knobs.for_call(max_blocks, rows, tile_size=128)
    assert chosen.key_prefetch is prefetch
    assert replace(chosen, key_prefetch=knobs.key_prefetch) == knobs  # nothing else changes


@pytest.mark.parametrize(
    ("knobs", "rows", "wide"),
    [
        (ScoreTuning(prefetch_max_blocks=512), 128, True),  # the package shape: 128 keys a step on 8 warps
        (ScoreTuning(prefetch_max_blocks=512, mma_store=True, tree_max=True), 128, True),
        (ScoreTuning(prefetch_max_blocks=512), 64, False),  # probing: not measured at d = 256
        (ScoreTuning(tiles_per_program=2), 128, False),  # the pair walk: not measured there
        (ScoreTuning(block_n=128), 128, False),  # a shape set by hand stays as set
        (ScoreTuning(key_prefetch=True), 128, False),
    ],
)
def test_wide_heads_take_the_wide_tile_shape(knobs, rows, wide) -> None:
    # d = 256 (measured on the H200, bit-identical indices): 128 pooled keys a step on 8 warps, without the
    # short-call prefetch, which that shape was not measured with; d <= 128 keeps the package shape.
    chosen = knobs.for_call(256, rows, tile_size=128, head_dim=256)
    if wide:
        assert (chosen.block_n, chosen.num_warps, chosen.key_prefetch) == (128, 8, False)
        assert replace(chosen, block_n=knobs.block_n, num_warps=knobs.num_warps) == knobs
    else:
        assert chosen == knobs
    narrow = knobs.for_call(256, rows, tile_size=128, head_dim=128)
    assert (narrow.block_n, narrow.num_warps) == (knobs.block_n, knobs.num_warps)


def test_select_launches_with_the_per_call_knobs(monkeypatch) -> None:
    # The selection hands the per-call choice to the kernel launch (short call: the prefetch is on).
    w = planted_workload(
        [50, 21], [400, 90], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, block_size=16,
        dtype=torch.float16, device=DEVICE, seed=3,
    )  # fmt: skip
    config = _small_config()
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=config.block_size)
    seen = []
    launch = scoring.launch_score_select

    def spy(*args, **kwargs):
        seen.append(kwargs["knobs"])
        return launch(*args, **kwargs)

    monkeypatch.setattr("fpv2.index.triton.api.launch_score_select", spy)
    previous = set_tuning(score=replace(tuning.SCORE, prefetch_max_blocks=512))
    try:
        got = select_blocks_triton(w.q, w.batch, stats, config=config, exact_nnz=True)
        set_tuning(score=replace(tuning.SCORE, prefetch_max_blocks=0))
        plain = select_blocks_triton(w.q, w.batch, stats, config=config, exact_nnz=True)
    finally:
        set_tuning(score=previous[0])
    assert [k.key_prefetch for k in seen] == [True, False]
    _assert_identical(got, plain)


def test_pair_kernel_takes_the_variants() -> None:
    # Two tiles per program with the light tail, tree maxima and the polynomial: the pair walk's own paths.
    w = planted_workload(
        [70, 45, 3], [1300, 700, 60], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, block_size=16,
        fraction=0.25, margin=1.0, dtype=torch.float16, device=DEVICE, seed=4,
    )  # fmt: skip
    config = _small_config(tile_size=32, dense_tail_tiles=0)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    one = _select_variant({}, w.q, w.batch, stats, config, workspace=IndexWorkspace(max_programs=3))
    ratios = _reference_ratios(w.q, w.batch, stats, config)
    exact = {"tiles_per_program": 2, **EXACT}
    for overrides in (exact, {**exact, "poly_exp2": 1}):
        got = _select_variant(overrides, w.q, w.batch, stats, config, workspace=IndexWorkspace(max_programs=3))
        if "poly_exp2" in overrides:
            _compare(got, one, ratios, config.alpha)  # near-threshold flips only
        else:
            _assert_identical(got, one)


def test_variants_with_fp8_query_descales() -> None:
    from test_triton_index import _fp8_inputs

    w = planted_workload(
        [40, 30], [400, 30], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, block_size=16,
        fraction=0.25, margin=1.0, device=DEVICE,
    )  # fmt: skip
    q8, k8, _, q_ds, k_ds, _ = _fp8_inputs(w, 2)
    config = _small_config(tile_size=32, dense_tail_tiles=0)
    stats = pool_blocks_triton(k8, None, w.batch, block_size=16, k_descale=k_ds)
    args = dict(q_descale=q_ds, k_descale=k_ds)
    default = _select_variant({}, q8, w.batch, stats, config, **args)
    _assert_identical(_select_variant({**EXACT, "key_prefetch": True}, q8, w.batch, stats, config, **args), default)
    ratios = _reference_ratios(q8, w.batch, stats, config, q_descale=q_ds)
    poly = _select_variant({**EXACT, "poly_exp2": 1}, q8, w.batch, stats, config, **args)
    _compare(poly, default, ratios, config.alpha)


# --------------------------------------------------------------------------- GPU (H200) tests
@gpu
@needs_cuda
@pytest.mark.parametrize(("overrides", "exact"), [*VARIANT_PARAMS, *CUDA_ONLY_PARAMS])
def test_gpu_variant_identical_bf16(overrides, exact, record_property) -> None:
    w = planted_workload(
        [3000, 0, 1500, 8192],
        [9000, 500, 1500, 8192],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=1,
        dtype=torch.bfloat16,
        device="cuda",
    )
    config = SelectionConfig(min_sparse_kv_len=1024)
    stats = pool_blocks_triton(w.k_cache, None, w.batch)
    for probe in (1, 2):
        probed = replace(config, probe_stride=probe)
        default = _select_variant({}, w.q, w.batch, stats, probed)
        got = _select_variant(overrides, w.q, w.batch, stats, probed)
        if exact:
            _assert_identical(got, default)
        else:
            ratios = _reference_ratios(w.q, w.batch, stats, probed)
            flips, scored = _compare(got, default, ratios, probed.alpha)
            record_property(f"flips_vs_default_probe{probe}", flips)
            assert flips <= max(1, scored // 10000)
