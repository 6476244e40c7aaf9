"""Checks shared by every selection strategy: queries, statistics and descales against the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fpv2.kernel.contracts import (
    ACTIVATION_DTYPES,
    SUPPORTED_HEAD_DIMS,
    BlockStatistics,
    PagedPrefillBatch,
    num_key_blocks,
)

from ..config import SelectionConfig


@dataclass(frozen=True)
class SelectionShapes:
    """Sizes a strategy needs, derived from checked inputs.

    Attributes:
        num_q_heads: ``Hq``.
        num_kv_heads: ``Hkv`` (from the statistics).
        head_dim: ``d``.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """GQA group size ``g = Hq / Hkv``."""
        return self.num_q_heads // self.num_kv_heads


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_statistics(
    statistics: BlockStatistics, batch: PagedPrefillBatch, block_size: int, *, read_offsets: bool = True
) -> None:
    """Check that ``statistics`` pooled this batch's KV in blocks of ``block_size``.

    Args:
        statistics: pooled keys (and values) of every block of every request.
        batch: the prefill batch.
        block_size: the block size the caller selects with.
        read_offsets: compare ``block_offsets`` with the batch's blocks (a device read: a host sync on a
            GPU). A caller that never reads a pooled row (the dense strategy) passes False.

    Raises:
        TypeError: ``statistics`` is not a :class:`BlockStatistics`.
        ValueError: block size, device or per-request block counts disagree.
    """
    if not isinstance(statistics, BlockStatistics):
        raise TypeError(f"statistics must be a BlockStatistics, got {type(statistics).__name__}")
    if statistics.block_size != block_size:
        raise ValueError(
            f"statistics were pooled with block_size={statistics.block_size}, the selection uses "
            f"block_size={block_size}; pool with the same block size"
        )
    if statistics.pooled_k.device != batch.device:
        raise ValueError(
            f"statistics.pooled_k must be on the batch's device {batch.device}; got {_describe(statistics.pooled_k)}"
        )
    if not read_offsets:
        return
    expected = [0]
    for kv_len in batch.host.seqlens_k:
        expected.append(expected[-1] + num_key_blocks(kv_len, block_size))
    got = statistics.block_offsets.cpu().tolist()
    if got != expected:
        raise ValueError(
            f"statistics.block_offsets {got[:8]} do not match the batch's blocks per request {expected[:8]} "
            f"(seqlens_k {batch.host.seqlens_k[:8]}, block_size {block_size})"
        )


def check_selection_inputs(
    q: torch.Tensor,
    batch: PagedPrefillBatch,
    statistics: BlockStatistics,
    config: SelectionConfig,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    read_offsets: bool = True,
) -> SelectionShapes:
    """Validate the inputs of :meth:`SelectionStrategy.select`.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        batch: the prefill batch.
        statistics: pooled keys of the batch, in real units (FP8 descales applied).
        config: selection parameters.
        q_descale: ``(B, Hkv) float32``, required for ``float8_e4m3fn`` queries, refused otherwise.
        k_descale: ``(B, Hkv) float32`` or None; accepted only with FP8 queries.
        read_offsets: as in :func:`check_statistics`.

    Returns:
        The :class:`SelectionShapes` of the call.

    Raises:
        TypeError: wrong type or dtype, naming the argument, shape and dtype.
        ValueError: inconsistent shapes or values, naming the argument.
    """
    if not isinstance(config, SelectionConfig):
        raise TypeError(f"config must be a SelectionConfig, got {type(config).__name__}")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"q must have dtype in {ACTIVATION_DTYPES}; got {_describe(q)}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape (total_q, Hq, d); got {_describe(q)}")
    if q.device != batch.device:
        raise ValueError(f"q must be on the batch's device {batch.device}; got {_describe(q)}")
    if q.shape[0] != batch.total_q:
        raise ValueError(f"q must hold cu_seqlens_q[-1]={batch.total_q} packed queries; got {_describe(q)}")
    check_statistics(statistics, batch, config.block_size, read_offsets=read_offsets)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = statistics.num_kv_heads
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}; q has {_describe(q)}")
    if statistics.head_dim != head_dim:
        raise ValueError(
            f"statistics.pooled_k has head dim {statistics.head_dim} ({_describe(statistics.pooled_k)}), "
            f"q has {head_dim} ({_describe(q)})"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"Hq % Hkv != 0: q has Hq={num_q_heads} heads ({_describe(q)}), statistics have Hkv={num_kv_heads}"
        )
    is_fp8 = q.dtype == torch.float8_e4m3fn
    for name, scale in (("q_descale", q_descale), ("k_descale", k_descale)):
        if scale is None:
            if is_fp8 and name == "q_descale":
                raise ValueError(
                    f"q_descale is required for float8_e4m3fn queries (shape ({batch.num_requests}, {num_kv_heads}))"
                )
            continue
        if not is_fp8:
            raise ValueError(f"{name} is only meaningful for float8_e4m3fn inputs; q has dtype {q.dtype}")
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            got = _describe(scale) if isinstance(scale, torch.Tensor) else type(scale).__name__
            raise TypeError(
                f"{name} must be a float32 tensor of shape ({batch.num_requests}, {num_kv_heads}); got {got}"
            )
        if tuple(scale.shape) != (batch.num_requests, num_kv_heads) or scale.device != batch.device:
            raise ValueError(
                f"{name} must have shape ({batch.num_requests}, {num_kv_heads}) on {batch.device}; "
                f"got {_describe(scale)}"
            )
    return SelectionShapes(num_q_heads, num_kv_heads, head_dim)
