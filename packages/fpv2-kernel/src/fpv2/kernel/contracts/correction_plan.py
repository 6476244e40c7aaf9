"""Block statistics and the mean-correction plan a kernel applies for pruned blocks."""

from __future__ import annotations

from dataclasses import InitVar, dataclass

import torch

from ._checks import check_contiguous, check_positive_int, check_shape, check_tensor, describe
from .geometry import BLOCK_SIZE
from .key_spread import KeySpread

#: Pooled blocks handled per correction step (one 64-bit todo word).
CORRECTION_CHUNK = 64


@dataclass(frozen=True, eq=False)
class BlockStatistics:
    """Pooled keys/values and lengths of every key block of every request.

    Block ``J`` of request ``b`` is row ``block_offsets[b] + J``. The pooled
    vectors are means over the block's *valid* tokens (the tail block averages
    over its real length ``block_lengths``), accumulated and stored in fp32.
    For FP8 caches the pooled vectors are already dequantised (descales applied).

    Args:
        pooled_k: ``(total_blocks, Hkv, d) float32``.
        pooled_v: ``(total_blocks, Hkv, d) float32`` or None (index-only use).
        block_lengths: ``(total_blocks,) int32`` valid tokens per block (1..block_size).
        block_offsets: ``(B+1,) int32`` cumulative blocks per request.
        block_size: tokens per block.
    """

    pooled_k: torch.Tensor
    pooled_v: torch.Tensor | None
    block_lengths: torch.Tensor
    block_offsets: torch.Tensor
    block_size: int = BLOCK_SIZE
    check_values: InitVar[bool] = False

    def __post_init__(self, check_values: bool) -> None:
        check_positive_int("block_size", self.block_size, power_of_two=True)
        pk = check_tensor("pooled_k", self.pooled_k, dtypes=(torch.float32,), ndim=3)
        device = pk.device
        if self.pooled_v is not None:
            check_tensor("pooled_v", self.pooled_v, dtypes=(torch.float32,), ndim=3, device=device)
            check_shape("pooled_v", self.pooled_v, tuple(pk.shape))
        check_tensor("block_lengths", self.block_lengths, dtypes=(torch.int32,), ndim=1, device=device)
        check_shape("block_lengths", self.block_lengths, (pk.shape[0],))
        check_tensor("block_offsets", self.block_offsets, dtypes=(torch.int32,), ndim=1, device=device)
        for name in ("pooled_k", "block_lengths", "block_offsets"):
            check_contiguous(name, getattr(self, name))
        if check_values:
            off = self.block_offsets.cpu()
            if int(off[0]) != 0 or int(off[-1]) != pk.shape[0] or (off[1:] < off[:-1]).any():
                raise ValueError(
                    f"block_offsets must run from 0 to total_blocks={pk.shape[0]} non-decreasing; got {describe(off)}"
                )
            lengths = self.block_lengths.cpu()
            if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > self.block_size):
                raise ValueError(f"block_lengths must lie in 1..{self.block_size}")

    @property
    def num_kv_heads(self) -> int:
        """``Hkv``."""
        return self.pooled_k.shape[1]

    @property
    def head_dim(self) -> int:
        """``d``."""
        return self.pooled_k.shape[2]


@dataclass(frozen=True, eq=False)
class CorrectionPlan:
    """What the kernel adds back for pruned blocks, segment by segment.

    A block ``J`` of segment ``s`` (same segment order as the block index) is
    *eligible* when it is not kept and fully visible to the tile's first row,
    ``J < (prefix + p_first) // block_size``. The eligible range of a segment is
    walked in chunks of :data:`CORRECTION_CHUNK` blocks; bit ``i`` of word ``w``
    of the segment is set when block ``w * 64 + i`` is eligible ("todo").
    Words of segment ``s`` are ``todo_masks[todo_offsets[s]:todo_offsets[s+1]]``.

    When ``todo_masks`` is None the kernel derives the bits itself from the
    block index by the same rule (a two-pointer scan over the sorted ids).

    Each todo block enters the row's online softmax as one extra key
    ``pooled_k[J]`` with logit ``q . pooled_k[J] * scale + log(block_lengths[J])``
    and value ``pooled_v[J]``. With a ``key_spread`` the logit also gains the
    second-order mass shift ``min(scale^2 |q|^2 variance[J] / 2, scale |q| radius[J])``
    (:attr:`mass_shift` ``"second_order"``); a kernel that does not apply it refuses
    the plan rather than dropping the term.
    """

    statistics: BlockStatistics
    todo_offsets: torch.Tensor | None = None
    todo_masks: torch.Tensor | None = None
    chunk_size: int = CORRECTION_CHUNK
    key_spread: KeySpread | None = None

    def __post_init__(self) -> None:
        if self.chunk_size != CORRECTION_CHUNK:
            raise ValueError(f"chunk_size must be {CORRECTION_CHUNK} (one 64-bit todo word); got {self.chunk_size}")
        if self.statistics.pooled_v is None:
            raise ValueError("the correction needs pooled values: statistics.pooled_v is None")
        if (self.todo_offsets is None) != (self.todo_masks is None):
            raise ValueError("todo_offsets and todo_masks come together (both tensors or both None)")
        if self.todo_offsets is not None:
            device = self.statistics.pooled_k.device
            check_tensor("todo_offsets", self.todo_offsets, dtypes=(torch.int32,), ndim=1, device=device)
            check_tensor("todo_masks", self.todo_masks, dtypes=(torch.int64,), ndim=1, device=device)
        if self.key_spread is not None:
            if not isinstance(self.key_spread, KeySpread):
                raise TypeError(f"key_spread must be a KeySpread or None; got {type(self.key_spread).__name__}")
            self.key_spread.check_fits(self.statistics.pooled_k)

    @property
    def mass_shift(self) -> str:
        """``"mean"`` (logit shift ``log |B_J|`` only) or ``"second_order"`` (a ``key_spread`` is given)."""
        return "mean" if self.key_spread is None else "second_order"
