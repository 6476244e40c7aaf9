"""Opt-in CUDA-graph capture of the index stage for repeated calls at one fixed shape.

:func:`~fpv2.index.triton.pool_blocks_triton` + :func:`~fpv2.index.triton.select_blocks_triton`
make no host sync on their fast path, so the pair can be captured once and
replayed: a replay costs one graph launch of host time instead of the Python
and launch work of every call. The price is that everything is fixed at
capture: the tensors (the replay reads whatever ``q``, the caches and the
batch's tensors hold then, so new inputs are copied into them in place), the
batch's lengths and the configuration; and the outputs are the same tensors
on every replay, overwritten by the next one (clone what must outlive it).
"""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch
from fpv2.kernel.triton.relaunch import interpreter_enabled

from ..config import SelectionConfig
from .api import pool_blocks_triton, select_blocks_triton
from .workspace import IndexWorkspace


class GraphedIndex:
    """The index stage (pooling, then selection) captured in a CUDA graph; :meth:`replay` reruns it.

    Capture happens in the constructor, after ``warmup`` eager calls on a side
    stream (they compile the kernels, size the graph's own workspace and read
    ``batch.host`` once).

    Args:
        q: ``(total_q, Hq, d)`` packed queries (CUDA).
        k_cache: ``(num_pages, page_size, Hkv, d)`` key cache.
        v_cache: value cache, or None to pool keys only.
        batch: the paged prefill batch (its lengths are fixed for the graph's life).
        config: selection parameters.
        q_descale: FP8 query descales, as for :func:`select_blocks_triton`.
        k_descale: FP8 key descales, as for :func:`pool_blocks_triton`.
        v_descale: FP8 value descales.
        warmup: eager calls before the capture (at least 1).

    Attributes:
        statistics: the graph's pooled statistics (rewritten by every replay).
        index: the graph's block index (rewritten by every replay; ``blocks`` has spare capacity).
        workspace: the scratch the graph owns.

    Raises:
        RuntimeError: the inputs are not on a CUDA device, or Triton runs under the interpreter
            (CUDA graphs exist on CUDA only: call the two functions directly there).
    """

    def __init__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        batch: PagedPrefillBatch,
        *,
        config: SelectionConfig,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
        warmup: int = 2,
    ) -> None:
        device = q.device if isinstance(q, torch.Tensor) else None
        if device is None or device.type != "cuda" or interpreter_enabled() or not torch.cuda.is_available():
            where = "under TRITON_INTERPRET=1" if interpreter_enabled() else f"on {device}"
            raise RuntimeError(
                f"GraphedIndex captures a CUDA graph and needs CUDA tensors without the Triton interpreter; got q "
                f"{where}. Call pool_blocks_triton and select_blocks_triton directly instead."
            )
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an int >= 1, got {warmup!r}")
        _ = batch.host  # the batch's one host read: never inside the capture
        self.workspace = IndexWorkspace(device)

        def run() -> tuple[BlockStatistics, BlockIndex]:
            stats = pool_blocks_triton(
                k_cache,
                v_cache,
                batch,
                block_size=config.block_size,
                k_descale=k_descale,
                v_descale=v_descale,
                query_dtype=q.dtype,
                softmax_scale=config.softmax_scale,
            )
            index = select_blocks_triton(
                q, batch, stats, config=config, q_descale=q_descale, k_descale=k_descale, workspace=self.workspace
            )
            return stats, index

        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run()
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.statistics, self.index = run()

    def replay(self) -> tuple[BlockStatistics, BlockIndex]:
        """Rerun the captured index stage on the current stream.

        Returns:
            ``(statistics, index)``: the graph's own output tensors, overwritten by the next replay.
        """
        self.graph.replay()
        return self.statistics, self.index
