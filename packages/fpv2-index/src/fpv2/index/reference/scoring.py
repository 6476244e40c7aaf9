"""Block energies of query tiles: the scoring half of the max-threshold selector.

For a tile with packed rows ``r`` at absolute positions ``pos_r`` and pooled
keys ``kbar_J`` (ALGORITHM.md section 3):

- logits, in log2 units: ``s_rJ = (q_r . kbar_J) * scale * log2(e)``;
- candidates: ``J < num_scored`` (blocks fully visible to the tile's last row);
- row ``r`` contributes to ``J`` only if the block's first token is visible to
  it: ``J * Bk <= pos_r``;
- one tile maximum ``M`` over all contributing ``(r, J)``, and energies
  ``E_J = sum_r 2^(s_rJ - M)`` over the rows contributing to ``J``.

Two equivalent computations are given: :func:`block_energies` materialises
every logit of the tile (the definition), :func:`block_energies_online` makes
a single pass over chunks of pooled keys with a running maximum and rescales
the energies of earlier chunks when it grows, as the fused kernel does.

Every function works on ``T`` tiles at once (``T = 1`` is one tile); rows that
do not exist or are not probed carry position ``-1`` and contribute nothing.
Energies of non-candidates are 0; a tile with no contributing pair has
``M = -inf`` and all energies 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

#: ``log2(e)``: logits are kept in log2 units so energies are powers of two.
LOG2E = math.log2(math.e)
#: Pooled keys per step of the online pass (one kernel N-tile of pooled vectors).
DEFAULT_CHUNK_BLOCKS = 64


class TileEnergies(NamedTuple):
    """Result of scoring ``T`` tiles.

    Attributes:
        energies: ``(T, nb) float32`` ``E_J`` relative to the tile maximum; 0 for non-candidates.
        tile_max: ``(T,) float32`` tile maximum ``M`` in log2 units; ``-inf`` when nothing contributes.
    """

    energies: torch.Tensor
    tile_max: torch.Tensor


def block_logits(rows: torch.Tensor, pooled_k: torch.Tensor, scale: float) -> torch.Tensor:
    """Logits of every row against every pooled key, in log2 units.

    Args:
        rows: ``(T, Mt, d) float32`` packed query rows.
        pooled_k: ``(nb, d) float32`` pooled keys of one KV head, in real units.
        scale: softmax scale times the FP8 descales (natural-log units).

    Returns:
        ``(T, Mt, nb) float32`` ``s_rJ = (q_r . kbar_J) * scale * log2(e)``.
    """
    return torch.matmul(rows, pooled_k.transpose(0, 1)) * (scale * LOG2E)


def contribution_mask(
    row_positions: torch.Tensor, num_scored: torch.Tensor, block_begin: int, block_end: int, block_size: int
) -> torch.Tensor:
    """Which (row, block) pairs of blocks ``block_begin .. block_end - 1`` enter the energies.

    Args:
        row_positions: ``(T, Mt) int64`` absolute row positions, ``-1`` for absent rows.
        num_scored: ``(T,) int64`` candidates per tile (``J < num_scored``).
        block_begin: first block id of the range.
        block_end: one past the last block id of the range.
        block_size: tokens per key block ``Bk``.

    Returns:
        ``(T, Mt, block_end - block_begin) bool``: ``J < num_scored[t]`` and ``J * Bk <= pos_r``.
    """
    ids = torch.arange(block_begin, block_end, device=row_positions.device, dtype=torch.int64)
    candidate = ids[None, :] < num_scored[:, None]  # (T, n)
    visible = ids[None, None, :] * block_size <= row_positions[:, :, None]  # (T, Mt, n)
    return visible & candidate[:, None, :]


def _check_inputs(
    rows: torch.Tensor, row_positions: torch.Tensor, num_scored: torch.Tensor, pooled_k: torch.Tensor
) -> None:
    """Shapes of the scoring inputs must agree (a reference should fail loudly, not broadcast)."""
    if rows.dim() != 3 or rows.dtype != torch.float32:
        raise ValueError(f"rows must be (T, Mt, d) float32; got shape {tuple(rows.shape)}, dtype {rows.dtype}")
    if tuple(row_positions.shape) != tuple(rows.shape[:2]):
        raise ValueError(f"row_positions must have shape {tuple(rows.shape[:2])}; got {tuple(row_positions.shape)}")
    if tuple(num_scored.shape) != (rows.shape[0],):
        raise ValueError(f"num_scored must have shape ({rows.shape[0]},); got {tuple(num_scored.shape)}")
    if pooled_k.dim() != 2 or pooled_k.shape[1] != rows.shape[2] or pooled_k.dtype != torch.float32:
        raise ValueError(
            f"pooled_k must be (nb, {rows.shape[2]}) float32; got shape {tuple(pooled_k.shape)}, dtype {pooled_k.dtype}"
        )


def _finite_or_zero(m: torch.Tensor) -> torch.Tensor:
    """Replace ``-inf`` maxima by 0 so ``2^(-inf - m)`` is 0 instead of NaN."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _empty(num_tiles: int, device: torch.device) -> TileEnergies:
    """Energies of tiles scored against no pooled key."""
    return TileEnergies(
        torch.zeros(num_tiles, 0, dtype=torch.float32, device=device),
        torch.full((num_tiles,), -math.inf, dtype=torch.float32, device=device),
    )


def block_energies(
    rows: torch.Tensor,
    row_positions: torch.Tensor,
    num_scored: torch.Tensor,
    pooled_k: torch.Tensor,
    *,
    scale: float,
    block_size: int,
) -> TileEnergies:
    """Block energies of ``T`` tiles, computed directly from the full logit matrix.

    Args:
        rows: ``(T, Mt, d) float32`` packed query rows.
        row_positions: ``(T, Mt) int64`` absolute row positions, ``-1`` for absent rows.
        num_scored: ``(T,) int64`` candidate blocks per tile.
        pooled_k: ``(nb, d) float32`` pooled keys (``nb`` may exceed every ``num_scored``).
        scale: softmax scale times the FP8 descales.
        block_size: tokens per key block.

    Returns:
        :class:`TileEnergies` with ``(T, nb)`` energies and ``(T,)`` maxima.

    Raises:
        ValueError: the input shapes disagree.
    """
    _check_inputs(rows, row_positions, num_scored, pooled_k)
    nb = pooled_k.shape[0]
    if nb == 0:  # a request with no complete block: nothing to score
        return _empty(rows.shape[0], rows.device)
    logits = block_logits(rows, pooled_k, scale)
    mask = contribution_mask(row_positions, num_scored, 0, nb, block_size)
    masked = torch.where(mask, logits, torch.full_like(logits, -math.inf))
    tile_max = masked.flatten(1).amax(dim=1)
    energies = torch.exp2(masked - _finite_or_zero(tile_max)[:, None, None]).sum(dim=1)
    return TileEnergies(energies, tile_max)


def block_energies_online(
    rows: torch.Tensor,
    row_positions: torch.Tensor,
    num_scored: torch.Tensor,
    pooled_k: torch.Tensor,
    *,
    scale: float,
    block_size: int,
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
) -> TileEnergies:
    """Block energies of ``T`` tiles in one pass over chunks of pooled keys.

    Keeps only a running tile maximum and the energies seen so far: when a chunk
    raises the maximum from ``M`` to ``M'``, earlier energies are multiplied by
    ``2^(M - M')``. Equal to :func:`block_energies` up to rounding.

    Args:
        rows: ``(T, Mt, d) float32`` packed query rows.
        row_positions: ``(T, Mt) int64`` absolute row positions, ``-1`` for absent rows.
        num_scored: ``(T,) int64`` candidate blocks per tile.
        pooled_k: ``(nb, d) float32`` pooled keys.
        scale: softmax scale times the FP8 descales.
        block_size: tokens per key block.
        chunk_blocks: pooled keys per step.

    Returns:
        :class:`TileEnergies` with ``(T, nb)`` energies and ``(T,)`` maxima.

    Raises:
        ValueError: the input shapes disagree or ``chunk_blocks < 1``.
    """
    _check_inputs(rows, row_positions, num_scored, pooled_k)
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    num_tiles, nb = rows.shape[0], pooled_k.shape[0]
    energies = torch.zeros(num_tiles, nb, dtype=torch.float32, device=rows.device)
    running = torch.full((num_tiles,), -math.inf, dtype=torch.float32, device=rows.device)
    for begin in range(0, nb, chunk_blocks):
        end = min(begin + chunk_blocks, nb)
        logits = block_logits(rows, pooled_k[begin:end], scale)
        mask = contribution_mask(row_positions, num_scored, begin, end, block_size)
        masked = torch.where(mask, logits, torch.full_like(logits, -math.inf))
        new_max = torch.maximum(running, masked.flatten(1).amax(dim=1))
        # Rescale what earlier chunks accumulated relative to the old maximum (0 if there was none).
        rescale = torch.where(torch.isfinite(running), torch.exp2(running - _finite_or_zero(new_max)), 0.0)
        energies[:, :begin] *= rescale[:, None]
        energies[:, begin:end] = torch.exp2(masked - _finite_or_zero(new_max)[:, None, None]).sum(dim=1)
        running = new_max
    return TileEnergies(energies, running)
