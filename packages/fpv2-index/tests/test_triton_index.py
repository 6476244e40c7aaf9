"""The fused Triton index stage against the PyTorch reference.

CPU runs use the Triton interpreter (``TRITON_INTERPRET=1``, set by the nox
session) on tiny fp16/fp32 shapes (its bf16 ``tl.dot`` is broken); without the
interpreter the same tests run natively on CUDA. ``gpu`` tests take larger
shapes, bf16 and FP8, and check that the fast path makes no host sync.

Selection is compared block by block with :func:`fpv2.index.reference.select_blocks`.
A block may differ only when the reference's energy ratio ``E_J / max E`` lies
within a relative ``NEAR`` of ``alpha`` (rounding of a different summation
order and dot precision); such near-threshold flips are counted and reported,
any other difference fails.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("triton")

from fpv2.index.config import SelectionConfig
from fpv2.index.reference import (
    block_energies,
    dense_tile_mask,
    forced_blocks,
    is_dense_tile,
    request_tiles,
    select_blocks,
    tile_rows,
)
from fpv2.index.triton import (
    IndexWorkspace,
    compaction,
    interpreter_enabled,
    pool_blocks_triton,
    scoring,
    select_blocks_triton,
)
from fpv2.index.triton.api import capacity_bound
from fpv2.index.triton.compaction import launch_compact, segment_offsets
from fpv2.index.triton.tuning import PoolTuning, ScoreTuning, set_tuning
from fpv2.index.triton.workspace import words_per_segment
from fpv2.kernel.contracts import BlockIndex, PagedPrefillBatch, num_key_blocks, num_query_tiles, tile_span
from fpv2.kernel.reference.pooling import pool_blocks
from fpv2.kernel.testing import planted_workload

INTERPRET = interpreter_enabled()
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRET else "cuda"

pytestmark = [
    pytest.mark.skipif(
        not (INTERPRET or HAS_CUDA),
        reason="the Triton index stage needs a CUDA GPU or the Triton interpreter (TRITON_INTERPRET=1)",
    ),
    # The interpreter evaluates log2(0) = -inf for blocks no row contributes to, with a numpy warning.
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning"),
]
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")

#: Relative distance of a reference energy ratio from ``alpha`` within which a kept/dropped flip is tolerated.
NEAR = 1e-2


# --------------------------------------------------------------------------- helpers
def _small_config(**overrides: object) -> SelectionConfig:
    """A config whose forced blocks leave room for scoring on tiny requests (16-token blocks)."""
    fields = dict(
        alpha=0.3,
        block_size=16,
        tile_size=64,
        sink_tokens=16,
        window_tokens=16,
        dense_tail_tiles=1,
        min_sparse_kv_len=0,
    )
    fields.update(overrides)
    return SelectionConfig(**fields)


def _reference_ratios(q, batch, stats, config, q_descale=None) -> torch.Tensor:
    """``(S, nb_max) float32`` reference ``E_J / max E`` per segment; NaN where the block is not scored."""
    host = batch.host
    hkv = stats.num_kv_heads
    group = q.shape[1] // hkv
    bk = config.block_size
    nb_max = max([num_key_blocks(k, bk) for k in host.seqlens_k] + [1])
    offsets = stats.block_offsets.cpu().tolist()
    scales = q_descale.cpu() if q_descale is not None else None
    out = []
    for b in range(batch.num_requests):
        q_len, prefix, kv_len = host.q_lens[b], host.prefix[b], host.seqlens_k[b]
        if q_len == 0:
            continue
        tiles = request_tiles(q_len, prefix, group, tile_size=config.tile_size, block_size=bk, device=q.device)
        nb = num_key_blocks(kv_len, bk)
        dense = dense_tile_mask(tiles.num_tiles, kv_len, config, q.device).cpu()
        q_b = q[host.cu_seqlens_q[b] : host.cu_seqlens_q[b + 1]]
        for h in range(hkv):
            ratio = torch.full((tiles.num_tiles, nb_max), math.nan)
            if nb:
                scale = config.scale_for(q.shape[2]) * (float(scales[b, h]) if scales is not None else 1.0)
                energies, _ = block_energies(
                    tile_rows(q_b, group, h, config.tile_size),
                    tiles.probe_positions(config.probe_stride),
                    tiles.num_scored_blocks,
                    stats.pooled_k[offsets[b] : offsets[b] + nb, h].float(),
                    scale=scale,
                    block_size=bk,
                )
                energies = energies.cpu()
                peak = energies.amax(dim=1, keepdim=True)
                scored = torch.arange(nb)[None, :] < tiles.num_scored_blocks.cpu()[:, None]
                r = torch.where(scored & (peak > 0), energies / peak.clamp_min(1e-30), math.nan)
                r[dense] = math.nan
                ratio[:, :nb] = r
            out.append(ratio)
    return torch.cat(out) if out else torch.zeros(0, nb_max)


def _shift_logits(w, kv_head: int, shift_log2: float, block: int | None) -> None:
    """Add about ``shift_log2`` (log2 units) to the logits of KV head ``kv_head``'s segments, in place.

    The last coordinate of every query of the head's group becomes ``A`` and that of its keys ``C`` with
    ``A * C * scale * log2(e) = shift_log2``: for every key (``block`` None) or only the tokens of key block
    ``block`` of the first request (a key that outgrows the ones scored before it).
    """
    d = w.q.shape[2]
    group = w.q.shape[1] // w.k_cache.shape[2]
    product = abs(shift_log2) / (d**-0.5 * math.log2(math.e))
    a = math.copysign(math.sqrt(product), shift_log2)
    c = math.sqrt(product)
    w.q[:, kv_head * group : (kv_head + 1) * group, d - 1] = a
    if block is None:
        w.k_cache[:, :, kv_head, d - 1] = c
        return
    page_size = w.k_cache.shape[1]
    positions = torch.arange(block * 128, (block + 1) * 128, device=w.q.device)
    pages = w.batch.page_table[0, positions // page_size].long()
    w.k_cache[pages, positions % page_size, kv_head, d - 1] = c


#: (shift in log2 units, block or None) cases of _shift_logits: logits far outside the planted workload's range.
EXTREME_LOGIT_CASES = [
    pytest.param(200.0, None, id="every-logit-up-200"),  # sums of 2^s overflow without an offset
    pytest.param(-200.0, None, id="every-logit-down-200"),  # and underflow
    pytest.param(150.0, 100, id="late-key-up-150"),  # outgrows the running maximum of the first 64 keys
]


def _compare(got: BlockIndex, ref: BlockIndex, ratios: torch.Tensor, alpha: float) -> tuple[int, int]:
    """Assert ``got`` equals ``ref`` except near-threshold flips; return ``(flips, scored pairs)``."""
    assert torch.equal(got.tile_offsets.cpu(), ref.tile_offsets.cpu())
    assert got.num_segments == ref.num_segments
    got.validate_values()
    nb = ratios.shape[1]
    a = got.to_dense_mask(nb).cpu()
    b = ref.to_dense_mask(nb).cpu()
    diff = a ^ b
    near = (ratios - alpha).abs() <= NEAR * alpha  # NaN (not scored) is never near
    far = diff & ~near
    if far.any():
        s, j = (int(x) for x in torch.nonzero(far)[0])
        raise AssertionError(
            f"{int(far.sum())} blocks differ away from the threshold; first: segment {s}, block {j}, "
            f"reference ratio {float(ratios[s, j])}, kept by triton {bool(a[s, j])}, by reference {bool(b[s, j])}"
        )
    return int(diff.sum()), int(torch.isfinite(ratios).sum())


def _fp8_inputs(w, num_kv_heads: int):
    """Quantise a planted workload to e4m3 with per (request, KV head) descales."""
    batch = w.batch
    host = batch.host
    group = w.q.shape[1] // num_kv_heads
    q = w.q.float()
    q_ds = torch.empty(batch.num_requests, num_kv_heads)
    q8 = torch.empty_like(q)
    for b in range(batch.num_requests):
        rows = slice(host.cu_seqlens_q[b], host.cu_seqlens_q[b + 1])
        for h in range(num_kv_heads):
            part = q[rows, h * group : (h + 1) * group]
            q_ds[b, h] = max(float(part.abs().amax()) if part.numel() else 0.0, 1e-3) / 448.0
            q8[rows, h * group : (h + 1) * group] = part / q_ds[b, h]
    # One cache-wide scale per KV head, repeated per request (the cache is shared by the batch).
    k, v = w.k_cache.float(), w.v_cache.float()
    k_ds = (k.abs().amax(dim=(0, 1, 3)).clamp_min(1e-3) / 448.0)[None, :].repeat(batch.num_requests, 1)
    v_ds = (v.abs().amax(dim=(0, 1, 3)).clamp_min(1e-3) / 448.0)[None, :].repeat(batch.num_requests, 1)
    k8 = (k / k_ds[0][None, None, :, None]).to(torch.float8_e4m3fn)
    v8 = (v / v_ds[0][None, None, :, None]).to(torch.float8_e4m3fn)
    dev = w.q.device
    return (
        q8.to(torch.float8_e4m3fn),
        k8,
        v8,
        q_ds.to(dev).contiguous(),
        k_ds.to(dev).contiguous(),
        v_ds.to(dev).contiguous(),
    )


# --------------------------------------------------------------------------- pooling
@pytest.fixture(params=[1, 2, 4], ids=lambda h: f"heads{h}")
def pool_heads(request):
    """Pool with ``heads`` KV heads per program (4 > Hkv = 2: the masked extra heads), then restore the knobs."""
    previous = set_tuning(pool=PoolTuning(tokens=16, num_warps=2, heads=request.param))
    yield request.param
    set_tuning(pool=previous[1])


@pytest.mark.usefixtures("pool_heads")
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pool_matches_reference(page_size: int, dtype: torch.dtype) -> None:
    # Tails of 5 and 11 tokens, a zero-length request, and a KV-less request.
    w = planted_workload(
        [3, 0, 21, 0],
        [37, 27, 21, 0],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=page_size,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
        seed=page_size,
    )
    got = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16)
    ref = pool_blocks(w.k_cache, w.v_cache, w.batch, block_size=16)
    assert got.block_size == 16
    assert torch.equal(got.block_offsets.cpu(), ref.block_offsets.cpu())
    assert torch.equal(got.block_lengths.cpu(), ref.block_lengths.cpu())
    assert got.block_lengths.cpu().tolist() == [16, 16, 5, 16, 11, 16, 5]
    torch.testing.assert_close(got.pooled_k, ref.pooled_k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.pooled_v, ref.pooled_v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("page_size", "tokens"), [(1, 4), (4, 4), (8, 8), (16, 8), (128, 8)])
def test_pool_steps_gather_pages_by_the_gather_knob(page_size: int, tokens: int, monkeypatch) -> None:
    # Pages smaller than a step (every token a gather) take gather_tokens a step, the rest tokens (measured
    # on the H200: 4 tokens a step pool page 1 faster, page 128 slower).
    knobs = PoolTuning(tokens=8, gather_tokens=4)
    assert knobs.tokens_for(page_size, 128) == tokens
    assert knobs.tokens_for(page_size, 2) == 2  # never past the block
    from fpv2.index.triton import pooling

    seen = []
    monkeypatch.setattr(pooling, "_POOL", lambda grid, *args, **meta: seen.append(meta["TOKENS"]))
    previous = set_tuning(pool=knobs)
    try:
        w = planted_workload([0], [40], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=page_size, device=DEVICE)
        pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16)
    finally:
        set_tuning(pool=previous[1])
    assert seen == [min(tokens, 16)]
    with pytest.raises(ValueError, match="pooling knobs"):
        set_tuning(pool=PoolTuning(gather_tokens=3))


def test_pool_block_size_and_keys_only() -> None:
    w = planted_workload([9, 40], [50, 40], num_q_heads=2, num_kv_heads=1, head_dim=128, page_size=16, device=DEVICE)
    w_k = w.k_cache.to(torch.float32)
    got = pool_blocks_triton(w_k, None, w.batch, block_size=32)
    ref = pool_blocks(w_k, None, w.batch, block_size=32)
    assert got.pooled_v is None
    assert got.block_lengths.cpu().tolist() == [32, 18, 32, 8]
    torch.testing.assert_close(got.pooled_k, ref.pooled_k, rtol=1e-5, atol=1e-6)
    # Independent check of one tail block: a plain mean of its tokens through the page table.
    table = w.batch.page_table.cpu()
    tokens = [w_k[int(table[0, p // 16]), p % 16, 0].cpu() for p in range(32, 50)]
    torch.testing.assert_close(got.pooled_k[1, 0].cpu(), torch.stack(tokens).mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("pool_heads")
def test_pool_fp8_descales() -> None:
    w = planted_workload(
        [20, 7], [45, 30], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, block_size=16, device=DEVICE
    )
    _, k8, v8, _, k_ds, v_ds = _fp8_inputs(w, 2)
    k_ds = k_ds * torch.tensor([[1.0, 2.0], [0.5, 1.0]], device=k_ds.device)  # per-request descales differ
    got = pool_blocks_triton(k8, v8, w.batch, block_size=16, k_descale=k_ds, v_descale=v_ds)
    ref = pool_blocks(k8, v8, w.batch, block_size=16, k_descale=k_ds, v_descale=v_ds)
    torch.testing.assert_close(got.pooled_k, ref.pooled_k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.pooled_v, ref.pooled_v, rtol=1e-5, atol=1e-6)


def test_pool_rejects_bad_inputs() -> None:
    w = planted_workload([8], [20], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache"):
        pool_blocks_triton(w.k_cache[:, :8], None, w.batch)
    with pytest.raises(TypeError, match="k_cache"):
        pool_blocks_triton(w.k_cache.to(torch.int32), None, w.batch)
    with pytest.raises(ValueError, match="k_descale"):
        pool_blocks_triton(w.k_cache, None, w.batch, k_descale=torch.ones(1, 1, device=DEVICE))
    with pytest.raises(ValueError, match="k_descale is required"):
        pool_blocks_triton(w.k_cache.to(torch.float8_e4m3fn), None, w.batch)
    with pytest.raises(ValueError, match="block_size"):
        pool_blocks_triton(w.k_cache, None, w.batch, block_size=48)


# --------------------------------------------------------------------------- selection
# (Hq, Hkv, d, page size, tile size, probe stride, dtype): GQA 1/4/7/8, d 64/128/256.
SELECTION_CASES = [
    (2, 2, 64, 16, 64, 1, torch.float16),
    (8, 2, 64, 1, 64, 2, torch.float32),
    (7, 1, 128, 16, 128, 1, torch.float16),  # 128 rows split a group of 7
    (16, 2, 64, 64, 128, 3, torch.float16),
    (8, 2, 128, 16, 32, 1, torch.float32),
    (8, 2, 256, 16, 64, 1, torch.float16),  # d > 128: the wide-head tile shape (128 keys a step, 8 warps)
    (4, 1, 256, 1, 128, 2, torch.float32),  # d > 128 probed: the package shape
]


@pytest.mark.parametrize(("hq", "hkv", "d", "page_size", "tile", "probe", "dtype"), SELECTION_CASES)
def test_select_matches_reference(hq, hkv, d, page_size, tile, probe, dtype, record_property) -> None:
    # Varlen with a cached prefix, a zero-length request and a request with no prefix.
    w = planted_workload(
        [90, 0, 140],
        [300, 40, 140],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        block_size=16,
        fraction=0.25,
        margin=3.0,
        dtype=dtype,
        device=DEVICE,
        seed=hq + d,
    )
    config = _small_config(tile_size=tile, probe_stride=probe)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    ref = select_blocks(w.q, w.batch, stats, config=config)
    got = select_blocks_triton(w.q, w.batch, stats, config=config, workspace=IndexWorkspace(max_programs=3))
    ratios = _reference_ratios(w.q, w.batch, stats, config)
    flips, scored = _compare(got, ref, ratios, config.alpha)
    record_property("near_threshold_flips", flips)
    print(f"near-threshold flips: {flips} of {scored} scored pairs; density {ref.density(w.batch):.3f}")
    # The test must exercise the threshold: some scored blocks kept, some dropped.
    kept = ref.to_dense_mask(ratios.shape[1]).cpu()
    scored_mask = torch.isfinite(ratios)
    assert (kept & scored_mask).any() and (~kept & scored_mask).any()
    assert flips <= max(1, scored // 100)
    assert got.group == hq // hkv and got.tile_size == tile and got.block_size == 16


@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("probe", [1, 2, 3])
def test_select_unmasked_steps_match_reference(block_n: int, probe: int, monkeypatch) -> None:
    # Long enough prefixes that tiles have whole steps of blocks every row sees (scored without masks),
    # followed by a masked step; two requests so the kernel's request lookup changes mid-walk.
    w = planted_workload(
        [70, 40],
        [2300, 1500],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        block_size=16,
        fraction=0.2,
        margin=3.0,
        dtype=torch.float16,
        device=DEVICE,
        seed=11 + probe,
    )
    config = _small_config(tile_size=32, probe_stride=probe, dense_tail_tiles=0)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    ref = select_blocks(w.q, w.batch, stats, config=config)
    # Several pass-2 threshold steps and several compaction steps per segment (144 blocks).
    monkeypatch.setattr(scoring, "PASS2_MAX_BLOCKS", 64)
    monkeypatch.setattr(compaction, "MAX_STEP_BITS", 64)
    previous = set_tuning(score=ScoreTuning(block_n=block_n, num_warps=4 if block_n == 64 else 8))
    try:
        got = select_blocks_triton(w.q, w.batch, stats, config=config, workspace=IndexWorkspace(max_programs=3))
    finally:
        set_tuning(score=previous[0])
    ratios = _reference_ratios(w.q, w.batch, stats, config)
    flips, scored = _compare(got, ref, ratios, config.alpha)
    assert flips <= max(1, scored // 100)


@pytest.mark.parametrize("probe", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_energies_match_reference(probe: int, dtype: torch.dtype) -> None:
    # One segment (one request, one KV head, one 64-row tile of 32 positions x 2 heads) on one program, so
    # the program's workspace row ends up holding that segment's log2 energies. The tile covers positions
    # 268..299: block 17 starts inside it, so only the rows at or after position 272 contribute to it.
    w = planted_workload(
        [32], [300], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=dtype, device=DEVICE, seed=5
    )
    config = _small_config(dense_tail_tiles=0, probe_stride=probe)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    ws = IndexWorkspace(max_programs=1)
    select_blocks_triton(w.q, w.batch, stats, config=config, workspace=ws)
    views = ws.reserve(num_programs=1, max_blocks=19, num_segments=1, device=torch.device(DEVICE))
    num_scored = 300 // 16
    log2_energy = views.energies[0, :num_scored].double().cpu()
    got = torch.exp2(log2_energy - log2_energy.max())
    ratios = _reference_ratios(w.q, w.batch, stats, config)[0, :num_scored].double()
    assert torch.isfinite(ratios).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16 rounds the pooled keys for the dot
    torch.testing.assert_close(got, ratios, rtol=tol, atol=1e-12)


@pytest.mark.parametrize(("shift_log2", "block"), EXTREME_LOGIT_CASES)
def test_select_extreme_logits_match_reference(shift_log2: float, block: int | None) -> None:
    """Logits hundreds of log2 units from zero, or one late key far above the earlier ones: same index.

    KV head 0 gets the shift, KV head 1 is the control; 2,048 queries after a 14,336-token prefix (128 key
    blocks, more than one step of the pass).
    """
    torch.manual_seed(11)
    w = planted_workload([2048], [16384], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                         dtype=torch.bfloat16, device=DEVICE)  # fmt: skip
    _shift_logits(w, 0, shift_log2, block)
    config = SelectionConfig(min_sparse_kv_len=0)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=config.block_size)
    got = select_blocks_triton(w.q, w.batch, stats, config=config)
    ratios = _reference_ratios(w.q, w.batch, stats, config)
    flips, scored = _compare(got, select_blocks(w.q, w.batch, stats, config=config), ratios, config.alpha)
    assert scored > 0 and flips <= max(2, scored // 1000)
    if block is not None:  # the late key dominates KV head 0's tiles
        assert bool(got.to_dense_mask(ratios.shape[1])[: got.num_segments // 2, block].all())


def test_pool_and_select_end_to_end() -> None:
    w = planted_workload(
        [40, 25],
        [40, 133],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        block_size=16,
        fraction=0.2,
        margin=3.0,
        dtype=torch.float16,
        device=DEVICE,
    )
    config = _small_config(alpha=0.2)
    stats_t = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16)
    stats_r = pool_blocks(w.k_cache, w.v_cache, w.batch, block_size=16)
    got = select_blocks_triton(w.q, w.batch, stats_t, config=config)
    ref = select_blocks(w.q, w.batch, stats_r, config=config)
    _compare(got, ref, _reference_ratios(w.q, w.batch, stats_r, config), config.alpha)
    got.check_compatible(w.batch, 4, tile_size=64)


@pytest.mark.parametrize("window", [0, 48])
def test_forced_and_dense_blocks_always_kept(window: int) -> None:
    # alpha = 1 keeps only the peak block among the scored ones: everything else must be forced or dense.
    w = planted_workload(
        [50, 9], [170, 9], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, block_size=16, device=DEVICE
    )
    w_q = w.q.to(torch.float16)
    config = _small_config(alpha=1.0, window_tokens=window, sink_tokens=20, tile_size=32, dense_tail_tiles=2)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    got = select_blocks_triton(w_q, w.batch, stats, config=config)
    host = w.batch.host
    peaks_seen = 0
    for b in range(w.batch.num_requests):
        ntiles = num_query_tiles(host.q_lens[b], 4, 32)
        for t in range(ntiles):
            span = tile_span(t, host.q_lens[b], host.prefix[b], 4, tile_size=32, block_size=16)
            kept = got.kept_blocks(b, 0, t)
            if is_dense_tile(t, ntiles, host.seqlens_k[b], config):
                assert kept == list(range(span.num_visible_blocks))
                continue
            forced = forced_blocks(span, config)
            assert set(forced) <= set(kept), (b, t, forced, kept)
            assert span.first_diagonal_block in kept and span.last_visible_block in kept  # even with window 0
            extra = sorted(set(kept) - set(forced))
            assert len(extra) <= 1 and all(j < span.num_scored_blocks for j in extra)
            peaks_seen += len(extra)
    assert peaks_seen > 0


def test_exact_nnz_false_pads_without_changing_the_index() -> None:
    w = planted_workload(
        [30, 50], [90, 50], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, block_size=16, device=DEVICE
    )
    q = w.q.to(torch.float16)
    config = _small_config()
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    exact = select_blocks_triton(q, w.batch, stats, config=config, exact_nnz=True)
    padded = select_blocks_triton(q, w.batch, stats, config=config, exact_nnz=False)
    assert torch.equal(exact.offsets, padded.offsets)
    nnz = int(exact.offsets[-1])
    # Room for every visible pair, at most one block per segment more (the O(B) bound); spare entries are
    # left uninitialised, which the contract allows (kernels never read past offsets[-1]).
    assert exact.visible_pairs(w.batch) <= padded.blocks.numel() <= exact.visible_pairs(w.batch) + exact.num_segments
    assert torch.equal(padded.blocks[:nnz], exact.blocks)


@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("tile_size", [16, 64, 128])
def test_capacity_bound_is_a_tight_upper_bound(group: int, tile_size: int) -> None:
    gen = torch.Generator().manual_seed(group * tile_size)
    q_lens = [0, 1, 5, 37, 200, 1000, *torch.randint(1, 3000, (4,), generator=gen).tolist()]
    prefix = [0, 7, 0, 300, 129, 0, *torch.randint(0, 5000, (4,), generator=gen).tolist()]
    batch = PagedPrefillBatch.contiguous(q_lens, [q + p for q, p in zip(q_lens, prefix)], page_size=16)
    for block_size in (16, 128):
        exact = 0
        tiles = 0
        for q_len, pre in zip(q_lens, prefix):
            n = num_query_tiles(q_len, group, tile_size)
            tiles += n
            for t in range(n):
                exact += tile_span(t, q_len, pre, group, tile_size=tile_size, block_size=block_size).num_visible_blocks
        bound = capacity_bound(batch, group, tile_size, block_size)
        assert exact <= bound <= exact + tiles, (block_size, exact, bound, tiles)


def test_workspace_reuse_and_bound() -> None:
    big = planted_workload(
        [60, 20], [200, 20], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    small = planted_workload([24], [60], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    config = _small_config(tile_size=32)
    ws = IndexWorkspace(max_programs=4)
    outputs = []
    for w in (big, small):
        batch = w.batch.to(DEVICE)
        q = w.q.to(DEVICE)
        stats = pool_blocks(w.k_cache.to(DEVICE), None, batch, block_size=16)
        outputs.append((select_blocks_triton(q, batch, stats, config=config, workspace=ws), q, batch, stats))
        if w is big:
            # 13 blocks; 8 + 3 tiles of 32 packed rows, 2 KV heads: S = 22 segments; P = 4 programs.
            expected = IndexWorkspace.required_bytes(4, 13, 22)
            assert expected == 4 * (4 * 13 + 22 * words_per_segment(13) + 22)
            assert ws.nbytes == expected
    assert ws.nbytes == expected  # the smaller call reuses the buffers
    for got, q, batch, stats in outputs:  # reuse did not leak state from the first call
        fresh = select_blocks_triton(q, batch, stats, config=config)
        nnz = int(fresh.offsets[-1])
        assert torch.equal(got.offsets, fresh.offsets) and torch.equal(got.blocks[:nnz], fresh.blocks[:nnz])


@pytest.mark.parametrize("step_bits", [64, 1024])
def test_compaction_matches_nonzero(step_bits: int, monkeypatch) -> None:
    monkeypatch.setattr(compaction, "MAX_STEP_BITS", step_bits)
    gen = torch.Generator().manual_seed(3)
    num_segments, max_blocks = 9, 150
    words = words_per_segment(max_blocks)
    mask = torch.rand(num_segments, words * 32, generator=gen) < 0.3
    mask[:, max_blocks:] = False
    mask[4] = False  # an empty segment
    bit_values = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    packed = (mask.view(num_segments, words, 32).long() * bit_values).sum(-1)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32).to(DEVICE)
    counts = mask.sum(1, dtype=torch.int32).to(DEVICE)
    offsets = segment_offsets(counts)
    blocks = torch.full((int(counts.sum()),), -7, dtype=torch.int32, device=DEVICE)
    launch_compact(packed, offsets, blocks)
    assert offsets.cpu().tolist()[1:] == mask.sum(1).cumsum(0).tolist()
    assert torch.equal(blocks.cpu(), torch.nonzero(mask)[:, 1].to(torch.int32))


def test_select_rejects_bad_inputs() -> None:
    w = planted_workload([20], [40], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device=DEVICE)
    q = w.q.to(torch.float16)
    config = _small_config()
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    with pytest.raises(TypeError, match="q must have dtype"):
        select_blocks_triton(q.to(torch.int32), w.batch, stats, config=config)
    with pytest.raises(ValueError, match="block_size"):
        select_blocks_triton(q, w.batch, stats, config=_small_config(block_size=32))
    with pytest.raises(ValueError, match="Hq % Hkv"):
        select_blocks_triton(q[:, :3], w.batch, stats, config=config)
    with pytest.raises(ValueError, match="q_descale is required"):
        select_blocks_triton(q.to(torch.float8_e4m3fn), w.batch, stats, config=config)
    with pytest.raises(ValueError, match="q_descale"):
        select_blocks_triton(q, w.batch, stats, config=config, q_descale=torch.ones(1, 2, device=DEVICE))
    with pytest.raises(TypeError, match="config"):
        select_blocks_triton(q, w.batch, stats, config=None)
    with pytest.raises(TypeError, match="workspace"):
        select_blocks_triton(q, w.batch, stats, config=config, workspace=object())


def test_fp8_selection_folds_the_query_descale() -> None:
    w = planted_workload(
        [40, 30],
        [100, 30],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        block_size=16,
        fraction=0.25,
        margin=3.0,
        device=DEVICE,
    )
    q8, k8, _, q_ds, k_ds, _ = _fp8_inputs(w, 2)
    config = _small_config()
    stats = pool_blocks_triton(k8, None, w.batch, block_size=16, k_descale=k_ds)
    ref = select_blocks(q8, w.batch, stats, config=config, q_descale=q_ds, k_descale=k_ds)
    got = select_blocks_triton(q8, w.batch, stats, config=config, q_descale=q_ds, k_descale=k_ds)
    _compare(got, ref, _reference_ratios(q8, w.batch, stats, config, q_descale=q_ds), config.alpha)


# --------------------------------------------------------------------------- GPU (H200) tests
@gpu
@needs_cuda
def test_gpu_8k_bf16_gqa4(record_property) -> None:
    w = planted_workload(
        [8192], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16, device="cuda"
    )
    config = SelectionConfig()
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=128)
    ref_stats = pool_blocks(w.k_cache, w.v_cache, w.batch, block_size=128)
    torch.testing.assert_close(stats.pooled_k, ref_stats.pooled_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.pooled_v, ref_stats.pooled_v, rtol=1e-5, atol=1e-5)
    got = select_blocks_triton(w.q, w.batch, ref_stats, config=config)
    ref = select_blocks(w.q, w.batch, ref_stats, config=config)
    flips, scored = _compare(got, ref, _reference_ratios(w.q, w.batch, ref_stats, config), config.alpha)
    record_property("near_threshold_flips", flips)
    print(f"8K bf16: {flips} near-threshold flips of {scored} scored pairs; density {ref.density(w.batch):.4f}")
    assert flips <= max(1, scored // 1000)


@gpu
@needs_cuda
def test_gpu_varlen_prefix_page1_bf16() -> None:
    w = planted_workload(
        [3000, 0, 1500, 700],
        [9000, 500, 1500, 12000],
        num_q_heads=28,
        num_kv_heads=4,
        head_dim=128,
        page_size=1,
        dtype=torch.bfloat16,
        device="cuda",
    )
    config = SelectionConfig(min_sparse_kv_len=1024, probe_stride=2)
    stats = pool_blocks_triton(w.k_cache, None, w.batch)
    ref_stats = pool_blocks(w.k_cache, None, w.batch)
    torch.testing.assert_close(stats.pooled_k, ref_stats.pooled_k, rtol=1e-5, atol=1e-5)
    got = select_blocks_triton(w.q, w.batch, ref_stats, config=config)
    ref = select_blocks(w.q, w.batch, ref_stats, config=config)
    _compare(got, ref, _reference_ratios(w.q, w.batch, ref_stats, config), config.alpha)


@gpu
@needs_cuda
def test_gpu_8k_fp8() -> None:
    w = planted_workload(
        [8192], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=64, dtype=torch.float32, device="cuda"
    )
    q8, k8, v8, q_ds, k_ds, v_ds = _fp8_inputs(w, 8)
    config = SelectionConfig()
    stats = pool_blocks_triton(k8, v8, w.batch, k_descale=k_ds, v_descale=v_ds)
    ref_stats = pool_blocks(k8, v8, w.batch, k_descale=k_ds, v_descale=v_ds)
    torch.testing.assert_close(stats.pooled_k, ref_stats.pooled_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.pooled_v, ref_stats.pooled_v, rtol=1e-5, atol=1e-5)
    got = select_blocks_triton(q8, w.batch, stats, config=config, q_descale=q_ds, k_descale=k_ds)
    ref = select_blocks(q8, w.batch, stats, config=config, q_descale=q_ds, k_descale=k_ds)
    _compare(got, ref, _reference_ratios(q8, w.batch, stats, config, q_descale=q_ds), config.alpha)


@gpu
@needs_cuda
def test_gpu_fast_path_makes_no_host_sync() -> None:
    w = planted_workload(
        [2048, 1000], [6000, 1000], num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda"
    )
    config = SelectionConfig(min_sparse_kv_len=0)
    ws = IndexWorkspace()
    batch = PagedPrefillBatch(
        w.batch.cu_seqlens_q, w.batch.seqlens_k, w.batch.page_table, w.batch.page_size, w.batch.num_pages
    )
    _ = batch.host  # the batch's own one-time host copy, cached before the fast path
    stats = pool_blocks_triton(w.k_cache, w.v_cache, batch)  # warm-up: compiles the kernels
    expected = select_blocks_triton(w.q, batch, stats, config=config, workspace=ws)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats = pool_blocks_triton(w.k_cache, w.v_cache, batch)
        index = select_blocks_triton(w.q, batch, stats, config=config, workspace=ws, exact_nnz=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    nnz = int(expected.offsets[-1])
    assert torch.equal(index.offsets, expected.offsets)
    assert torch.equal(index.blocks[:nnz], expected.blocks[:nnz])  # both carry spare capacity past nnz
    # With exact_nnz=True the only sync is the documented read of offsets[-1].
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            select_blocks_triton(w.q, batch, stats, config=config, workspace=ws, exact_nnz=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [c for c in caught if "synchroniz" in str(c.message)]
    assert len(syncs) <= 1, [str(c.message) for c in syncs]
