"""Two query tiles per program (``ScoreTuning.tiles_per_program = 2``) against one tile and the reference.

The two-tile kernel walks each pooled-key chunk once for tiles ``2u`` and
``2u + 1`` of a (request, KV head); each tile's energies come from the same
operands and reductions as with one tile per program, so the CSR must be
*identical* to the one-tile kernel's (offsets and blocks), and equal to the
reference up to near-threshold flips. Each case also checks that it could see
a mishandled second tile: some second tile keeps other scored blocks than its
partner, some request ends on a lone tile, and so on.

CPU runs use the Triton interpreter (``TRITON_INTERPRET=1``) on fp16/fp32 inputs;
``gpu`` tests repeat the identity on CUDA with bf16 and the MMA-layout store.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from test_triton_index import (  # pytest applies the imported pytestmark
    DEVICE,
    _compare,
    _reference_ratios,
    _small_config,
    needs_cuda,
    pytestmark,  # noqa: F401
)

from fpv2.index.config import SelectionConfig
from fpv2.index.reference import select_blocks
from fpv2.index.triton import IndexWorkspace, pool_blocks_triton, select_blocks_triton, tuning
from fpv2.index.triton.scoring import num_units
from fpv2.index.triton.tuning import ScoreTuning, set_tuning
from fpv2.kernel.contracts import BlockIndex, num_query_tiles, tile_span
from fpv2.kernel.reference.pooling import pool_blocks
from fpv2.kernel.testing import planted_workload


def _select_with(tiles: int, q, batch, stats, config: SelectionConfig, *, mma_store: bool = False, **kwargs):
    """``select_blocks_triton`` with ``tiles`` tiles per program (knobs restored afterwards), exact ``nnz``."""
    previous = set_tuning(score=replace(tuning.SCORE, tiles_per_program=tiles, mma_store=mma_store))
    try:
        return select_blocks_triton(q, batch, stats, config=config, exact_nnz=True, **kwargs)
    finally:
        set_tuning(score=previous[0])


def _assert_identical(got: BlockIndex, expected: BlockIndex) -> None:
    assert torch.equal(got.tile_offsets.cpu(), expected.tile_offsets.cpu())
    assert torch.equal(got.offsets.cpu(), expected.offsets.cpu())
    assert torch.equal(got.blocks.cpu(), expected.blocks.cpu())


def _partner_sensitivity(index: BlockIndex, batch, group: int, config: SelectionConfig) -> tuple[int, int]:
    """``(pairs whose second tile keeps other scored blocks than its first, lone last tiles)`` of ``index``.

    A kernel that gave the second tile of a pair its partner's selection, or dropped it, changes the
    CSR in the first count's pairs; a lone last tile (odd tile count) takes the kernel's absent-tile path.
    """
    host = batch.host
    differing = lone = 0
    for b in range(batch.num_requests):
        n = num_query_tiles(host.q_lens[b], group, config.tile_size)
        lone += n % 2
        for h in range(index.num_kv_heads):
            for t in range(0, n - 1, 2):
                span = tile_span(
                    t + 1,
                    host.q_lens[b],
                    host.prefix[b],
                    group,
                    tile_size=config.tile_size,
                    block_size=config.block_size,
                )
                scored = span.num_scored_blocks
                first = {j for j in index.kept_blocks(b, h, t) if j < scored}
                second = {j for j in index.kept_blocks(b, h, t + 1) if j < scored}
                differing += first != second
    return differing, lone


# (Hq, Hkv, page size, q lens, kv lens, tile, probe, dtype, dense tail tiles). Every case is varlen with
# cached prefixes, and has a request with an odd number of tiles and one shorter than a tile.
PAIR_CASES = [
    pytest.param(4, 4, 16, [90, 7, 140], [300, 40, 140], 64, 1, torch.float16, 1, id="gqa1-page16"),
    pytest.param(8, 2, 1, [90, 0, 140, 9], [300, 40, 140, 400], 64, 1, torch.float32, 1, id="gqa4-page1"),
    pytest.param(8, 1, 16, [70, 45, 3], [1300, 700, 60], 32, 1, torch.float16, 0, id="gqa8-page16-notail"),
    pytest.param(8, 1, 1, [70, 45, 3], [1300, 700, 60], 64, 2, torch.float16, 1, id="gqa8-page1-probe2"),
]


@pytest.mark.parametrize(("hq", "hkv", "page_size", "q_lens", "kv_lens", "tile", "probe", "dtype", "tail"), PAIR_CASES)
def test_two_tiles_give_the_one_tile_csr(hq, hkv, page_size, q_lens, kv_lens, tile, probe, dtype, tail) -> None:
    # A small margin: the queries' random parts decide much of the selection, so neighbouring tiles differ.
    w = planted_workload(
        q_lens,
        kv_lens,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=64,
        page_size=page_size,
        block_size=16,
        fraction=0.25,
        margin=1.0,
        dtype=dtype,
        device=DEVICE,
        seed=hq * 7 + page_size,
    )
    group = hq // hkv
    config = _small_config(tile_size=tile, probe_stride=probe, dense_tail_tiles=tail)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    one = _select_with(1, w.q, w.batch, stats, config, workspace=IndexWorkspace(max_programs=3))
    two = _select_with(2, w.q, w.batch, stats, config, workspace=IndexWorkspace(max_programs=3), mma_store=True)
    _assert_identical(two, one)
    ref = select_blocks(w.q, w.batch, stats, config=config)
    ratios = _reference_ratios(w.q, w.batch, stats, config)
    flips, scored = _compare(two, ref, ratios, config.alpha)
    assert flips <= max(1, scored // 100)
    # The case must be able to catch a mishandled second tile.
    differing, lone = _partner_sensitivity(one, w.batch, group, config)
    assert differing >= 2 and lone >= 1, (differing, lone)
    assert any(0 < n * group < tile for n in q_lens)  # a request shorter than one tile (a lone, partial tile)


def test_two_tiles_on_one_program_and_a_reused_workspace() -> None:
    # One program walks every unit (both tiles of a pair, then lone tiles), and the workspace of a one-tile
    # call is reused (it must grow its energies rows to two per program).
    w = planted_workload(
        [50, 21, 64],
        [400, 21, 200],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        block_size=16,
        fraction=0.25,
        margin=1.0,
        dtype=torch.float16,
        device=DEVICE,
        seed=3,
    )
    config = _small_config(tile_size=32)
    stats = pool_blocks_triton(w.k_cache, None, w.batch, block_size=16)
    ws = IndexWorkspace(max_programs=1)
    one = _select_with(1, w.q, w.batch, stats, config, workspace=ws)
    bytes_one = ws.nbytes
    two = _select_with(2, w.q, w.batch, stats, config, workspace=ws)
    _assert_identical(two, one)
    nb = max(-(-k // 16) for k in w.batch.host.seqlens_k)
    assert ws.nbytes - bytes_one == 4 * nb  # one more energies row for the one program


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_tiles_energies_of_both_rows(dtype: torch.dtype) -> None:
    # One request, one KV head, three 64-row tiles (32 positions of 2 heads; the third is partial): the single
    # program scores tile 2 alone, then tiles 0 and 1 together, so its two energies rows end up holding tiles
    # 0 and 1. Tile 1 covers positions 252..283: block 16 (tokens 256..271) starts inside it, so only its rows
    # at or after position 256 contribute there (the second tile's own masks).
    w = planted_workload(
        [80], [300], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=dtype, device=DEVICE, seed=5
    )
    config = _small_config(dense_tail_tiles=0)
    stats = pool_blocks(w.k_cache, None, w.batch, block_size=16)
    ws = IndexWorkspace(max_programs=1)
    _select_with(2, w.q, w.batch, stats, config, workspace=ws)
    views = ws.reserve(num_programs=1, max_blocks=19, num_segments=3, device=torch.device(DEVICE), tiles_per_program=2)
    ratios = _reference_ratios(w.q, w.batch, stats, config).double()
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # fp16 rounds the pooled keys for the dot
    for tile, num_scored in ((0, 252 // 16), (1, 284 // 16)):
        log2_energy = views.energies[tile, :num_scored].double().cpu()
        got = torch.exp2(log2_energy - log2_energy.max())
        assert torch.isfinite(ratios[tile, :num_scored]).all()
        torch.testing.assert_close(got, ratios[tile, :num_scored], rtol=tol, atol=1e-12)


def test_two_tiles_fp8_descale() -> None:
    from test_triton_index import _fp8_inputs

    w = planted_workload(
        [40, 30],
        [100, 30],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        block_size=16,
        fraction=0.25,
        margin=1.0,
        device=DEVICE,
    )
    q8, k8, _, q_ds, k_ds, _ = _fp8_inputs(w, 2)
    config = _small_config(tile_size=32)
    stats = pool_blocks_triton(k8, None, w.batch, block_size=16, k_descale=k_ds)
    args = dict(q_descale=q_ds, k_descale=k_ds)
    _assert_identical(
        _select_with(2, q8, w.batch, stats, config, **args), _select_with(1, q8, w.batch, stats, config, **args)
    )


def test_units_and_tuning_knobs() -> None:
    assert num_units([5, 0, 1, 4], 2) == 3 + 0 + 1 + 2
    assert num_units([5, 0, 1, 4], 1) == 10
    pair = ScoreTuning(tiles_per_program=2)
    assert pair.programs_for(128) == pair.pair_programs_per_sm
    assert pair.programs_for(128, head_dim=256) == 1
    # Two probed tiles hold about one full tile: the three programs per SM of 64-row tiles, at any probe.
    assert pair.programs_for(64) == pair.programs_for(16) == pair.probe_programs_per_sm[0]
    assert pair.stages_for(128) == pair.pair_num_stages and pair.stages_for(128, rows=64) == pair.num_stages
    assert pair.maxnreg_for(128) == pair.pair_maxnreg and pair.maxnreg_for(128, rows=64) == pair.maxnreg
    assert ScoreTuning().stages_for(128) == ScoreTuning().num_stages
    assert IndexWorkspace.required_bytes(4, 13, 22, tiles_per_program=2) - IndexWorkspace.required_bytes(4, 13, 22) == (
        4 * 4 * 13
    )
    for bad in (ScoreTuning(tiles_per_program=3), ScoreTuning(pair_maxnreg=32), ScoreTuning(pair_num_stages=0)):
        with pytest.raises(ValueError):
            set_tuning(score=bad)
    assert tuning.SCORE.tiles_per_program == 1  # the default, until measured on the GPU


# --------------------------------------------------------------------------- GPU (H200) tests
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mma_store", [False, True])
def test_gpu_two_tiles_identical_bf16(mma_store: bool) -> None:
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
    one = _select_with(1, w.q, w.batch, stats, config)
    two = _select_with(2, w.q, w.batch, stats, config, mma_store=mma_store)
    _assert_identical(two, one)
    for probe in (2, 8):
        probed = replace(config, probe_stride=probe)
        _assert_identical(
            _select_with(2, w.q, w.batch, stats, probed, mma_store=mma_store),
            _select_with(1, w.q, w.batch, stats, probed),
        )
