"""The paper's selector: keep blocks whose energy reaches ``alpha`` times the tile's largest."""

from __future__ import annotations

import os

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch

from ..config import SelectionConfig
from ..reference.selection import select_blocks
from .registry import register_strategy


@register_strategy("max_threshold")
class MaxThresholdStrategy:
    """Max-threshold selection with forced sink, window and diagonal blocks (ALGORITHM.md section 3).

    The default strategy. On CUDA inputs it runs the fused Triton kernel
    (:func:`fpv2.index.triton.select_blocks_triton`); elsewhere, or when the
    environment sets ``FPV2_INDEX_IMPL=reference``, the PyTorch reference
    (:func:`fpv2.index.reference.select_blocks`). Both produce the same index
    up to near-threshold rounding.

    Attributes:
        name: ``"max_threshold"``.
    """

    name = "max_threshold"

    def __init__(self) -> None:
        # One index workspace per (device, stream): calls on one stream are ordered, so they can
        # share scratch; buffers grow to the largest call and are not reallocated per call.
        self._workspaces: dict[tuple[torch.device, int], object] = {}

    def release_workspaces(self) -> int:
        """Drop the cached index workspaces (their buffers are freed once no call holds their views).

        The workspaces keep the capacity of the largest call they served; release them to give that
        memory back after an unusually long request, or to measure a workload's scratch from a fresh
        start (``fpv2.serving.soak`` does).

        Returns:
            The number of workspaces dropped.
        """
        dropped = len(self._workspaces)
        self._workspaces.clear()
        return dropped

    def _workspace_for(self, device: torch.device):
        """The index workspace of ``device``'s current stream (created on first use)."""
        from fpv2.kernel.triton.relaunch import raw_cuda_stream

        from ..triton import IndexWorkspace

        stream = 0
        if device.type == "cuda":
            # The raw current-stream handle, as the launches read it (no Stream object: ~0.2 against ~6.5 us).
            stream = raw_cuda_stream(device.index if device.index is not None else torch.cuda.current_device())
        key = (device, stream)
        workspace = self._workspaces.get(key)
        if workspace is None:
            workspace = self._workspaces[key] = IndexWorkspace(device)
        return workspace

    def select(
        self,
        q: torch.Tensor,
        batch: PagedPrefillBatch,
        statistics: BlockStatistics,
        *,
        config: SelectionConfig,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
    ) -> BlockIndex:
        """Select blocks by the max-threshold rule.

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            batch: the paged prefill batch.
            statistics: pooled keys (real units), pooled with ``config.block_size``.
            config: selection parameters.
            q_descale: ``(B, Hkv) float32`` query descales for FP8 queries.
            k_descale: ``(B, Hkv) float32`` key descales; checked only, since the
                statistics are already dequantised.

        Returns:
            The block index.
        """
        if use_triton_index(q):
            from ..triton import select_blocks_triton  # imports triton: only on the fast path

            return select_blocks_triton(
                q,
                batch,
                statistics,
                config=config,
                q_descale=q_descale,
                k_descale=k_descale,
                workspace=self._workspace_for(q.device),
            )
        return select_blocks(q, batch, statistics, config=config, q_descale=q_descale, k_descale=k_descale)


def use_triton_index(q: torch.Tensor) -> bool:
    """Whether the fused Triton index runs for ``q``: CUDA inputs, unless ``FPV2_INDEX_IMPL=reference``.

    Args:
        q: the packed queries.

    Returns:
        True for the Triton fast path.
    """
    return q.is_cuda and os.environ.get("FPV2_INDEX_IMPL", "auto") != "reference"
