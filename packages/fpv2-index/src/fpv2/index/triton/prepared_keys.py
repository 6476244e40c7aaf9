"""Pooled keys prepared for scoring (scaled to log2 logit units, cast to the dot dtype), made by the pooling kernel.

The fused scoring kernel reads the pooled keys as ``(pooled_k * scale * log2 e)``
cast to its dot dtype. :func:`~fpv2.index.triton.pool_blocks_triton` writes that
copy next to ``pooled_k`` from the same registers (the same fp32 product and
the same rounding as the separate preparation kernel, so the same bits) and
hands it over in :class:`TritonBlockStatistics`; the selection then launches
no preparation kernel. It prepares for the selection it expects (by default
``softmax_scale = 1 / sqrt(d)`` and queries of the cache's dtype); a
selection with another scale or query dtype, or statistics of another origin,
prepares its own keys as before.

The prepared copy is only used while it still describes ``pooled_k``: the same
tensor object, unmodified since pooling (its autograd version counter, which
every in-place torch operation bumps). Writes into ``pooled_k`` that bypass
torch (a custom kernel through its pointer) are not seen: rebuild the
statistics as a plain :class:`~fpv2.kernel.BlockStatistics` after such writes.

Asked for (``pooled_copy_dtype=torch.bfloat16``), the pooling kernel also writes
bf16 copies of ``pooled_k`` and ``pooled_v`` (:class:`PooledCopies`), the operands
of the Hopper kernel's correction: its binding takes them from
:meth:`TritonBlockStatistics.pooled_in` (looked up by name: ``fpv2.kernel`` does
not import this package) instead of converting the fp32 means on every call,
under the same guard (same tensors, unmodified since pooling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fpv2.kernel.contracts import BlockStatistics

#: ``log2(e)``: logits are scored in log2 units so energies are powers of two.
LOG2E = math.log2(math.e)

#: Dot operand kinds (constexpr ``DOT_KIND`` of the scoring kernel).
DOT_FP32, DOT_FP16, DOT_BF16 = 0, 1, 2
DOT_DTYPES = {DOT_FP32: torch.float32, DOT_FP16: torch.float16, DOT_BF16: torch.bfloat16}


def dot_kind(dtype: torch.dtype, interpret: bool) -> int:
    """Operand type of the scoring dot for queries of ``dtype``.

    Args:
        dtype: the query dtype.
        interpret: running under the Triton interpreter (whose bf16 ``tl.dot`` is broken: bf16 scores in fp32).

    Returns:
        :data:`DOT_FP32`, :data:`DOT_FP16` or :data:`DOT_BF16`.
    """
    if dtype == torch.float32:
        return DOT_FP32
    if dtype == torch.bfloat16:
        return DOT_FP32 if interpret else DOT_BF16
    return DOT_FP16  # fp16, and float8_e4m3fn upcast exactly


def logit_scale_log2(softmax_scale: float | None, head_dim: int) -> float:
    """The factor the keys are prepared with: the logit scale times ``log2(e)``.

    Args:
        softmax_scale: the selection's ``softmax_scale`` (None: ``1 / sqrt(head_dim)``).
        head_dim: ``d``.

    Returns:
        ``scale * log2(e)``, computed as :meth:`fpv2.index.SelectionConfig.scale_for` times :data:`LOG2E`.
    """
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    return scale * LOG2E


def version_of(t: torch.Tensor) -> int | None:
    """``t._version``, or None for an inference tensor (made under :func:`torch.inference_mode`), which keeps none.

    A record whose source has no version never matches: without a counter an in-place change cannot be seen.
    """
    return None if t.is_inference() else t._version


@dataclass(frozen=True, eq=False)
class PreparedKeys:
    """Pooled keys in log2 logit units and the dot dtype, and what they were made from.

    Attributes:
        keys: ``(total_blocks, Hkv, d)`` contiguous, dtype ``DOT_DTYPES[dot_kind]``.
        source: the ``pooled_k`` tensor they were computed from.
        source_version: ``source._version`` when they were written (:func:`version_of`; None: never matches).
        scale_log2: the factor applied (:func:`logit_scale_log2`).
        dot_kind: the dot operand kind they were cast for.
    """

    keys: torch.Tensor
    source: torch.Tensor
    source_version: int | None
    scale_log2: float
    dot_kind: int

    def matches(self, pooled_k: torch.Tensor, scale_log2: float, kind: int) -> bool:
        """Whether these are exactly the keys a selection with ``scale_log2`` and ``kind`` would prepare.

        Args:
            pooled_k: the statistics' pooled keys at selection time.
            scale_log2: the selection's factor.
            kind: the selection's dot kind.

        Returns:
            True when the source is the same unmodified tensor and the factor and dtype agree.
        """
        return (
            self.source is pooled_k
            and self.source_version is not None
            and version_of(pooled_k) == self.source_version
            and self.scale_log2 == scale_log2
            and self.dot_kind == kind
        )


@dataclass(frozen=True, eq=False)
class PooledCopies:
    """Copies of the pooled K and V in another dtype, written by the pooling kernel, and what they were made from.

    Attributes:
        k: ``(total_blocks, Hkv, d)`` contiguous copy of ``source_k``.
        v: the copy of ``source_v``, or None (keys pooled alone).
        source_k: the ``pooled_k`` tensor they were written from.
        source_v: the ``pooled_v`` tensor, or None.
        k_version: ``source_k``'s :func:`version_of` when they were written (None: never matches).
        v_version: ``source_v``'s then, or None (no values, or no counter: never matches).
    """

    k: torch.Tensor
    v: torch.Tensor | None
    source_k: torch.Tensor
    source_v: torch.Tensor | None
    k_version: int | None
    v_version: int | None

    @classmethod
    def of(
        cls, k: torch.Tensor, v: torch.Tensor | None, source_k: torch.Tensor, source_v: torch.Tensor | None
    ) -> PooledCopies:
        """The copies ``k``, ``v`` of ``source_k``, ``source_v`` as they are now (their versions recorded).

        Args:
            k: the copy of ``source_k``.
            v: the copy of ``source_v``, or None.
            source_k: pooled keys.
            source_v: pooled values, or None.

        Returns:
            The record.
        """
        v_version = version_of(source_v) if source_v is not None else None
        return cls(k, v, source_k, source_v, version_of(source_k), v_version)

    @property
    def dtype(self) -> torch.dtype:
        """The copies' dtype."""
        return self.k.dtype

    def matches(self, pooled_k: torch.Tensor, pooled_v: torch.Tensor | None) -> bool:
        """Whether these still copy ``pooled_k`` and ``pooled_v``: the same tensors, unmodified since.

        Args:
            pooled_k: the statistics' pooled keys now.
            pooled_v: the statistics' pooled values now (None matches a record without values).

        Returns:
            True when both are the recorded tensors at their recorded versions.
        """
        if self.source_k is not pooled_k or self.source_v is not pooled_v:
            return False
        if self.k_version is None or version_of(pooled_k) != self.k_version:
            return False
        return pooled_v is None or (self.v_version is not None and version_of(pooled_v) == self.v_version)


@dataclass(frozen=True, eq=False)
class TritonBlockStatistics(BlockStatistics):
    """:class:`~fpv2.kernel.BlockStatistics` from the Triton pooling kernel, carrying its prepared keys.

    A plain ``BlockStatistics`` everywhere else; :func:`~fpv2.index.triton.select_blocks_triton`
    uses :attr:`prepared_keys` when they match its scale and dot dtype (:meth:`PreparedKeys.matches`),
    the Hopper binding :meth:`pooled_in` when it hands the pooled K/V over in bf16.

    Attributes:
        prepared_keys: the scoring copy of ``pooled_k``, or None.
        pooled_copies: the kernel's copies of ``pooled_k`` and ``pooled_v`` in another dtype, or None.
    """

    prepared_keys: PreparedKeys | None = None
    pooled_copies: PooledCopies | None = None

    def pooled_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(pooled_k, pooled_v)`` in ``dtype`` from the pooling kernel's copies, while they are current.

        Args:
            dtype: the dtype wanted.

        Returns:
            The copies (``pooled_v``'s is None when the values were not pooled), or None when there are
            none in ``dtype`` or ``pooled_k`` / ``pooled_v`` were modified or replaced since pooling
            (:meth:`PooledCopies.matches`): the caller converts them itself then.
        """
        copies = self.pooled_copies
        if copies is None or copies.dtype != dtype or not copies.matches(self.pooled_k, self.pooled_v):
            return None
        return copies.k, copies.v


def matching_keys(statistics: BlockStatistics, scale_log2: float, kind: int) -> torch.Tensor | None:
    """The prepared keys of ``statistics`` if they are what a selection with ``scale_log2``, ``kind`` needs.

    Args:
        statistics: the statistics the selection runs on.
        scale_log2: the selection's factor.
        kind: the selection's dot kind.

    Returns:
        The keys, or None (the selection prepares its own).
    """
    prepared = getattr(statistics, "prepared_keys", None)
    if isinstance(prepared, PreparedKeys) and prepared.matches(statistics.pooled_k, scale_log2, kind):
        return prepared.keys
    return None
