"""A drifting background for the planted workload: inputs whose neighbouring blocks differ.

On the planted workload's i.i.d. N(0, 1) background every pooled key is close to
zero, so all pruned blocks look alike to the mean correction and variants of it
cannot be told apart (merging pooled terms in groups of 4 cost nothing there and
40-77% of the correction's gain on this background: ``benchmarks/NOTES.md``,
2026-12-05). Here
keys, values and queries follow an AR(1) process along the sequence, so that
blocks within a few correlation lengths resemble each other and farther ones do
not; keys and queries share a per-KV-head mean vector; both are rotated by RoPE,
which turns that mean into a bias towards recent keys, as in real models.
"""

from __future__ import annotations

import math

import torch

#: Tokens per chunk of the AR(1) generator: one small matrix product per chunk, one carry step between chunks.
_CHUNK = 32


def check_drift_tokens(drift_tokens: object) -> float:
    """The correlation length as a float, or ValueError unless it is a positive finite number of tokens."""
    if isinstance(drift_tokens, bool) or not isinstance(drift_tokens, (int, float)):
        raise ValueError(f"drift_tokens must be a positive finite number of tokens, got {drift_tokens!r}")
    if not (math.isfinite(drift_tokens) and drift_tokens > 0):
        raise ValueError(f"drift_tokens must be a positive finite number of tokens, got {drift_tokens!r}")
    return float(drift_tokens)


def ar1_sequence(length: int, shape: tuple[int, ...], drift_tokens: float, gen: torch.Generator) -> torch.Tensor:
    """A stationary AR(1) sequence ``(length, *shape)``: unit variance, correlation ``exp(-1 / drift_tokens)`` per step.

    Args:
        length: tokens.
        shape: the trailing shape of each token's vector (for example ``(heads, dim)``).
        drift_tokens: correlation length in tokens (> 0): tokens that far apart correlate by ``1 / e``.
        gen: the CPU generator the noise is drawn from.

    Returns:
        A float32 CPU tensor.

    Raises:
        ValueError: ``length`` negative or ``drift_tokens`` not a positive finite number.
    """
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    drift_tokens = check_drift_tokens(drift_tokens)
    width = math.prod(shape)
    if length == 0:
        return torch.empty(0, *shape)
    rho = math.exp(-1.0 / drift_tokens)
    chunks = -(-length // _CHUNK)
    noise = torch.randn(chunks * _CHUNK, width, generator=gen)
    # x_t = rho x_{t-1} + sqrt(1 - rho^2) e_t, started from x_0 = e_0 (already stationary). Within a chunk
    # this is a lower-triangular Toeplitz product; between chunks one carry per chunk.
    steps = torch.arange(_CHUNK, dtype=torch.float64)
    lag = steps[:, None] - steps[None, :]
    decay = torch.where(lag >= 0, rho ** lag.clamp(min=0), torch.zeros((), dtype=torch.float64))
    innovation = math.sqrt(1.0 - rho * rho)
    noise[0] /= innovation  # x_0 = e_0: unit variance from the first token
    local = torch.matmul((decay * innovation).float(), noise.view(chunks, _CHUNK, width))
    carry_weights = (rho ** (steps + 1)).float()[:, None]  # rho^(i+1) for token i of a chunk
    out = torch.empty_like(local)
    previous = torch.zeros(width)
    for c in range(chunks):
        out[c] = local[c] + carry_weights * previous
        previous = out[c, -1]
    return out.view(chunks * _CHUNK, *shape)[:length]


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``x (L, H, d)`` at ``positions (L,)`` (rotate-half convention, even ``d``).

    Args:
        x: vectors to rotate.
        positions: their absolute positions.
        base: RoPE's frequency base.

    Returns:
        The rotated vectors, same shape and dtype.
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = angles.cos().to(x.dtype)[:, None, :]
    sin = angles.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
