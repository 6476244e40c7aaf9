"""Knobs of the index stage, validated once, shared by every selection strategy."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fpv2.kernel.contracts import BLOCK_SIZE, TILE_SIZE


def _check_int(name: str, value: object, *, minimum: int, power_of_two: bool = False) -> None:
    """Refuse non-ints (bools included), values below ``minimum`` and, optionally, non powers of two."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SelectionConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"SelectionConfig.{name} must be >= {minimum}, got {value}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"SelectionConfig.{name} must be a power of two, got {value}")


@dataclass(frozen=True)
class SelectionConfig:
    """Parameters of block selection (ALGORITHM.md section 3).

    Defaults follow the paper (``alpha = 0.1`` at ``Bk = 128``, 256 sink tokens,
    a 512-token local window); they are the single source of defaults for the
    Python API, the command line and the engine adapters.

    Attributes:
        alpha: Max-threshold ratio in ``(0, 1]``: a scored block is kept when its
            energy is at least ``alpha`` times the tile's largest block energy.
            Larger is sparser. Default ``0.1``.
        block_size: Tokens per key block ``Bk`` (a power of two). Default ``128``.
        tile_size: Packed query rows per tile (PackGQA); must equal the attention
            kernel's query tile, which the kernel checks. Default ``128``.
        sink_tokens: Leading KV tokens whose blocks are always kept
            (``J * Bk < sink_tokens``). Default ``256``.
        window_tokens: Tokens immediately before the tile's first query position
            whose blocks are always kept. ``0`` disables the window; the diagonal
            band is kept regardless. Default ``512``.
        dense_tail_tiles: Number of last query tiles of each request that keep
            every causally visible block. Default ``1``.
        min_sparse_kv_len: Requests whose KV length (``seqlens_k``, prefix
            included) is below this keep every visible block. Default ``8192``.
        probe_stride: Score with every ``probe_stride``-th packed row of a tile,
            starting at its first row (``1`` = every row). Larger strides make
            scoring cheaper; blocks no probed row can see lie in the diagonal
            band, which is kept anyway. Default ``1``.
        softmax_scale: Scale of ``q . k`` logits; ``None`` means ``1 / sqrt(d)``.
            FP8 descales are applied on top of it. Default ``None``.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range; the message names the field and value.
    """

    alpha: float = 0.1
    block_size: int = BLOCK_SIZE
    tile_size: int = TILE_SIZE
    sink_tokens: int = 256
    window_tokens: int = 512
    dense_tail_tiles: int = 1
    min_sparse_kv_len: int = 8192
    probe_stride: int = 1
    softmax_scale: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise TypeError(f"SelectionConfig.alpha must be a float, got {type(self.alpha).__name__} {self.alpha!r}")
        if not (0.0 < self.alpha <= 1.0):  # also refuses NaN
            raise ValueError(f"SelectionConfig.alpha must lie in (0, 1], got {self.alpha}")
        _check_int("block_size", self.block_size, minimum=1, power_of_two=True)
        _check_int("tile_size", self.tile_size, minimum=1, power_of_two=True)
        _check_int("sink_tokens", self.sink_tokens, minimum=0)
        _check_int("window_tokens", self.window_tokens, minimum=0)
        _check_int("dense_tail_tiles", self.dense_tail_tiles, minimum=0)
        _check_int("min_sparse_kv_len", self.min_sparse_kv_len, minimum=0)
        _check_int("probe_stride", self.probe_stride, minimum=1)
        if self.softmax_scale is not None:
            scale = self.softmax_scale
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                raise TypeError(f"SelectionConfig.softmax_scale must be a float or None, got {type(scale).__name__}")
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"SelectionConfig.softmax_scale must be positive and finite, got {scale}")

    def scale_for(self, head_dim: int) -> float:
        """The logit scale for head dimension ``head_dim`` (before FP8 descales).

        Args:
            head_dim: ``d``.

        Returns:
            ``softmax_scale`` if set, else ``1 / sqrt(head_dim)``.
        """
        return float(self.softmax_scale) if self.softmax_scale is not None else 1.0 / math.sqrt(head_dim)
