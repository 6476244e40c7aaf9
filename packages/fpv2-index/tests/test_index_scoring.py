"""Block energies: a hand-computed example, row causality, and online == direct."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fpv2.index.reference import block_energies, block_energies_online, threshold_mask

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def hand_example():
    """Two rows at absolute positions 1 and 2, three one-token blocks, d = 2.

    ``scale = ln 2`` makes the log2 logits equal to plain dot products:
    row 0 = (1, 0), row 1 = (0, 1); kbar_0 = (0, 0), kbar_1 = (2, 1), kbar_2 = (1, 3).
    """
    rows = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    positions = torch.tensor([[1, 2]])
    num_scored = torch.tensor([3])  # (last position 2 + 1) // Bk=1
    pooled = torch.tensor([[0.0, 0.0], [2.0, 1.0], [1.0, 3.0]])
    return rows, positions, num_scored, pooled


@pytest.mark.parametrize("online", [False, True])
def test_hand_computed_energies(online):
    # s (log2 units): row 0 -> J0: 0, J1: 2, J2: 1 but row 0 (position 1) cannot see block 2 (first token 2).
    #                 row 1 -> J0: 0, J1: 1, J2: 3.
    # M = max(0, 2, 0, 1, 3) = 3.
    # E0 = 2^-3 + 2^-3 = 0.25; E1 = 2^-1 + 2^-2 = 0.75; E2 = 2^0 = 1 (1.25 if row 0 leaked into it).
    rows, positions, num_scored, pooled = hand_example()
    score = block_energies_online if online else block_energies
    kwargs = {"chunk_blocks": 1} if online else {}
    energies, tile_max = score(rows, positions, num_scored, pooled, scale=math.log(2.0), block_size=1, **kwargs)
    torch.testing.assert_close(energies, torch.tensor([[0.25, 0.75, 1.0]]), rtol=1e-6, atol=0)
    assert float(tile_max[0]) == pytest.approx(3.0, abs=1e-6)
    # Thresholds: alpha 0.8 -> {2}; 0.5 -> {1, 2}; 0.25 -> all three (ties are kept).
    for alpha, expected in ((0.8, [False, False, True]), (0.5, [False, True, True]), (0.25, [True, True, True])):
        assert threshold_mask(energies, num_scored, alpha)[0].tolist() == expected


def test_hand_example_candidates_and_padding():
    rows, positions, _, pooled = hand_example()
    # Only two candidates: block 2 gets no energy, and the maximum comes from the others (row 0 on J1: 2).
    energies, tile_max = block_energies(rows, positions, torch.tensor([2]), pooled, scale=math.log(2.0), block_size=1)
    torch.testing.assert_close(energies, torch.tensor([[2**-2 + 2**-2, 1.0 + 0.5, 0.0]]))
    assert float(tile_max[0]) == pytest.approx(2.0)
    # A padding row (position -1) contributes nothing: only row 0 remains.
    energies, _ = block_energies(
        rows, torch.tensor([[1, -1]]), torch.tensor([3]), pooled, scale=math.log(2.0), block_size=1
    )
    torch.testing.assert_close(energies, torch.tensor([[0.25, 1.0, 0.0]]))
    # No contributing pair at all: M = -inf and zero energies, nothing kept.
    energies, tile_max = block_energies(
        rows, torch.tensor([[-1, -1]]), torch.tensor([3]), pooled, scale=1.0, block_size=1
    )
    assert torch.isneginf(tile_max).all() and not energies.any()
    assert not threshold_mask(energies, torch.tensor([3]), 0.1).any()


def random_tiles(gen, num_tiles, rows, nb, d, block_size, spread):
    """Tiles at random absolute positions; logits spread wide so later chunks raise the running maximum."""
    q = torch.randn(num_tiles, rows, d, generator=gen)
    pooled = torch.randn(nb, d, generator=gen) * torch.linspace(0.1, spread, nb)[:, None]
    start = torch.randint(0, max(nb * block_size, 1), (num_tiles, 1), generator=gen)
    positions = start + torch.arange(rows)[None, :] // 2
    positions[:, -1:] = torch.where(torch.rand(num_tiles, 1, generator=gen) < 0.3, -1, positions[:, -1:])
    num_scored = (positions.amax(dim=1) + 1) // block_size
    return q, positions, torch.clamp(num_scored, max=nb), pooled


@SETTINGS
@given(
    num_tiles=st.integers(1, 4),
    rows=st.sampled_from([1, 8, 32]),
    nb=st.integers(0, 40),
    chunk=st.sampled_from([1, 3, 16, 64]),
    block_size=st.sampled_from([1, 4, 16]),
    spread=st.sampled_from([0.5, 4.0]),
    seed=st.integers(0, 10_000),
)
def test_online_equals_direct(num_tiles, rows, nb, chunk, block_size, spread, seed):
    gen = torch.Generator().manual_seed(seed)
    q, positions, num_scored, pooled = random_tiles(gen, num_tiles, rows, nb, 16, block_size, spread)
    direct = block_energies(q, positions, num_scored, pooled, scale=0.7, block_size=block_size)
    online = block_energies_online(
        q, positions, num_scored, pooled, scale=0.7, block_size=block_size, chunk_blocks=chunk
    )
    torch.testing.assert_close(online.tile_max, direct.tile_max, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(online.energies, direct.energies, rtol=1e-5, atol=1e-6)
    # Independent float64 energies: exp-sum relative to the maximum over contributing pairs.
    logits = (q.double() @ pooled.double().T) * 0.7
    ids = torch.arange(nb)
    mask = (ids[None, None, :] * block_size <= positions[:, :, None]) & (ids[None, None, :] < num_scored[:, None, None])
    masked = logits.masked_fill(~mask, -math.inf)
    m = masked.flatten(1).amax(dim=1) if nb else torch.full((num_tiles,), -math.inf, dtype=torch.float64)
    expected = torch.exp(masked - torch.where(torch.isfinite(m), m, 0)[:, None, None]).sum(dim=1)
    torch.testing.assert_close(direct.energies.double(), expected, rtol=1e-4, atol=1e-7)


def test_online_rescales_when_maximum_grows():
    # Later blocks dominate: with one block per chunk the running maximum rises at every step.
    q = torch.ones(1, 4, 8)
    pooled = torch.arange(6, dtype=torch.float32)[:, None].repeat(1, 8) / 8
    positions = torch.full((1, 4), 100)
    args = (q, positions, torch.tensor([6]), pooled)
    direct = block_energies(*args, scale=1.0, block_size=16)
    online = block_energies_online(*args, scale=1.0, block_size=16, chunk_blocks=1)
    torch.testing.assert_close(online.energies, direct.energies)
    # Independent: E_J = 4 * exp(J - 5) (four identical rows, logit J in natural units).
    expected = 4 * torch.exp(torch.arange(6.0) - 5)
    torch.testing.assert_close(direct.energies[0], expected, rtol=1e-5, atol=0)


@SETTINGS
@given(seed=st.integers(0, 10_000), block_size=st.sampled_from([1, 4, 16]), row=st.integers(0, 15))
def test_row_contribution_causality(seed, block_size, row):
    """Changing one row's query leaves the absolute energy ``E_J * 2^M`` of blocks it cannot see untouched."""
    gen = torch.Generator().manual_seed(seed)
    nb = 12
    q, positions, num_scored, pooled = random_tiles(gen, 1, 16, nb, 8, block_size, 1.0)
    positions = positions.clone()
    positions[0] = torch.arange(16) + int(positions[0, 0])  # one row per position, all real
    num_scored = torch.clamp((positions.amax(dim=1) + 1) // block_size, max=nb)

    def absolute(qq):
        e, m = block_energies(qq, positions, num_scored, pooled, scale=1.0, block_size=block_size)
        return e.double() * torch.exp2(m.double())[:, None]

    before = absolute(q)
    changed = q.clone()
    changed[0, row] = 5 * torch.randn(8, generator=gen)
    after = absolute(changed)
    unseen = torch.arange(nb) * block_size > positions[0, row]
    torch.testing.assert_close(after[0, unseen], before[0, unseen], rtol=1e-4, atol=1e-12)
    seen = ~unseen & (torch.arange(nb) < num_scored[0])
    if seen.any():  # and the row does count for the blocks it sees (its share may be small: any change counts)
        assert not torch.equal(after[0, seen], before[0, seen])


def test_scoring_shape_checks():
    rows, positions, num_scored, pooled = hand_example()
    with pytest.raises(ValueError, match="row_positions must have shape"):
        block_energies(rows, positions[:, :1], num_scored, pooled, scale=1.0, block_size=1)
    with pytest.raises(ValueError, match="pooled_k must be"):
        block_energies(rows, positions, num_scored, pooled[:, :1], scale=1.0, block_size=1)
    with pytest.raises(ValueError, match="chunk_blocks"):
        block_energies_online(rows, positions, num_scored, pooled, scale=1.0, block_size=1, chunk_blocks=0)
