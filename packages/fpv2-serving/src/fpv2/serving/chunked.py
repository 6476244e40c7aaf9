"""Chunked prefill that keeps the unchunked density: the pipeline run chunk by chunk with carried state.

An engine with chunked prefill splits a long prompt into chunks and prefills
each on top of the KV cached by the ones before. Re-running the index per
chunk (``chunk_aware=False`` here, the published implementation's behaviour)
applies the dense fallbacks to every chunk and re-pools the whole prefix each
time. :class:`ChunkedPrefillPipeline` with ``chunk_aware=True`` (the default)
keeps one :class:`~.chunked_state.ChunkedPrefillState` per request:

- pooling touches only the blocks the chunk adds or completes
  (:mod:`.chunked_pooling`);
- the dense fallbacks refer to the whole prompt (:mod:`.chunked_selection`),
  so a chunk's selection equals the unchunked selection restricted to its
  tiles when chunk starts fall on tile boundaries
  (``(chunk_start - prefill_start) * g % tile_size == 0``);
- thresholds stay per tile, as in the unchunked call.

Engines call :meth:`ChunkedPrefillPipeline.run_chunk` once per forward with
the chunk batch and the states of its requests; :meth:`ChunkedPrefillPipeline.run`
splits a whole prefill batch into equal chunks (for tests and benchmarks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from fpv2.correction import build_correction_plan
from fpv2.index import SelectionConfig
from fpv2.index.reference.forced import dense_tile_count
from fpv2.index.strategies.max_threshold import use_triton_index
from fpv2.kernel import BlockIndex, BlockStatistics, CorrectionPlan, PagedPrefillBatch, validate_prefill_inputs
from fpv2.kernel.contracts import num_key_blocks, num_query_tiles

from .backends import AUTO, AttentionBackend, output_dtype
from .chunked_pooling import batch_from_host, check_chunk_states, pool_chunk
from .chunked_selection import select_chunk_blocks
from .chunked_state import ChunkedPrefillState
from .chunked_tile_pages import carried_tile_copies, fused_tile_copy, release_finished_tile_pages, reserve_tile_pages
from .pipeline import DENSE_STRATEGY, PrefillResult, SparsePrefillPipeline, is_builtin_strategy
from .timing import StageClock, StageTimings
from .transfer import device_ints


@dataclass(frozen=True, eq=False)
class ChunkResult:
    """One chunk of a chunked prefill: its pipeline result and what it cost.

    Attributes:
        result: the :class:`~.pipeline.PrefillResult` of the chunk batch (output, index, plan,
            statistics, timings). In chunk-aware mode its statistics are views of the
            states' buffers, valid until the next chunk of the same requests.
        batch: the chunk batch the result was computed for.
        pooled_blocks: key blocks pooled for this chunk (all requests).
        dense_tiles: tiles (per KV head) kept dense by the fallbacks.
        requests: for chunks made by :meth:`ChunkedPrefillPipeline.run`, the requests of the whole
            batch in this chunk, in chunk-batch order; empty otherwise.
        query_rows: for :meth:`ChunkedPrefillPipeline.run`, ``(begin, end)`` rows of the whole batch's
            packed queries each chunk request covers; empty otherwise.
    """

    result: PrefillResult
    batch: PagedPrefillBatch
    pooled_blocks: int
    dense_tiles: int
    requests: tuple[int, ...] = ()
    query_rows: tuple[tuple[int, int], ...] = ()

    @property
    def out(self) -> torch.Tensor:
        """``(chunk_q, Hq, d)`` attention output of the chunk batch."""
        return self.result.out

    @property
    def index(self) -> BlockIndex:
        """The chunk's block index."""
        return self.result.index

    @property
    def timings(self) -> StageTimings:
        """Per-stage times of the chunk (reading them synchronises on CUDA)."""
        return self.result.timings

    @property
    def kept_pairs(self) -> int:
        """Kept (tile, block) pairs summed over KV heads (host sync)."""
        return self.index.nnz

    @property
    def visible_pairs(self) -> int:
        """Causally visible (tile, block) pairs summed over KV heads."""
        return self.index.visible_pairs(self.batch)


@dataclass(frozen=True, eq=False)
class ChunkedPrefillResult:
    """All chunks of one :meth:`ChunkedPrefillPipeline.run` call.

    Attributes:
        chunks: the per-chunk results, in order.
        batch: the whole (unchunked) batch.
        chunk_size: queries per chunk and request.
        out_shape: shape of the assembled output, ``(total_q, Hq, d)``.
        out_dtype: its element type.
    """

    chunks: tuple[ChunkResult, ...]
    batch: PagedPrefillBatch
    chunk_size: int
    out_shape: tuple[int, int, int]
    out_dtype: torch.dtype

    @cached_property
    def out(self) -> torch.Tensor:
        """``(total_q, Hq, d)`` output in the whole batch's packing, assembled from the chunks on first use."""
        device = self.batch.device
        out = torch.zeros(self.out_shape, dtype=self.out_dtype, device=device)
        for chunk in self.chunks:
            begin = 0
            for row_begin, row_end in chunk.query_rows:
                out[row_begin:row_end] = chunk.out[begin : begin + row_end - row_begin]
                begin += row_end - row_begin
        return out

    @property
    def kept_pairs(self) -> int:
        """Kept (tile, block) pairs over all chunks and KV heads (host sync)."""
        return sum(c.kept_pairs for c in self.chunks)

    @property
    def visible_pairs(self) -> int:
        """Causally visible (tile, block) pairs over all chunks and KV heads."""
        return sum(c.visible_pairs for c in self.chunks)

    def density(self) -> float:
        """Kept over visible pairs over the whole prefill (1.0 = dense).

        Returns:
            The density, comparable to :meth:`fpv2.kernel.BlockIndex.density` of an unchunked call.
        """
        visible = self.visible_pairs
        return self.kept_pairs / visible if visible else 1.0

    @property
    def pooled_blocks(self) -> int:
        """Key blocks pooled over all chunks."""
        return sum(c.pooled_blocks for c in self.chunks)

    @property
    def dense_tiles(self) -> int:
        """Tiles (per KV head) kept dense by the fallbacks, over all chunks."""
        return sum(c.dense_tiles for c in self.chunks)

    def stage_totals(self) -> StageTimings:
        """Stage times summed over the chunks (reading them synchronises on CUDA).

        Returns:
            The summed :class:`~.timing.StageTimings`.
        """
        times = [c.timings for c in self.chunks]
        return StageTimings(
            index_ms=sum(t.index_ms for t in times),
            correction_ms=sum(t.correction_ms for t in times),
            attention_ms=sum(t.attention_ms for t in times),
        )


class ChunkedPrefillPipeline:
    """The sparse prefill pipeline for chunked prefill, with chunk-aware selection and incremental pooling.

    Args:
        config: selection parameters (None: :class:`fpv2.index.SelectionConfig` defaults); the dense
            fallbacks in it refer to the whole prompt in chunk-aware mode.
        strategy: a selection strategy name (see :func:`fpv2.index.available_strategies`).
        correction: add the mean correction for pruned blocks.
        backend: ``"auto"``, a backend name, or a backend object.
        check_index: re-check every chunk's index against its batch on the device (two host
            syncs per chunk), as :class:`~.pipeline.SparsePrefillPipeline` does with it.
        chunk_aware: True (default): carry pooled statistics across chunks and decide the dense
            fallbacks on the whole prompt. False: run the plain
            :class:`~.pipeline.SparsePrefillPipeline` on every chunk as if it were a whole
            prefill (the naive baseline).
        carry_tile_pages: in chunk-aware mode, let a request keep its K/V in 128-token tile pages across
            its chunks where the backend says the copy pays (:mod:`.chunked_tile_pages`). False keeps the
            backend's per-call rule: an engine that holds states for every layer cannot afford a copy of
            each layer's prompt (about 0.5 GB a layer for a 128K prompt at 8 KV heads of 128).

    Raises:
        TypeError: ``config`` is not a SelectionConfig, or ``correction``/``check_index``/``chunk_aware``/
            ``carry_tile_pages`` not a bool.
        ValueError: unknown strategy or backend name.
        RuntimeError: the named backend is not available here.
    """

    def __init__(
        self,
        config: SelectionConfig | None = None,
        *,
        strategy: str = "max_threshold",
        correction: bool = True,
        backend: str | AttentionBackend = AUTO,
        check_index: bool = False,
        chunk_aware: bool = True,
        carry_tile_pages: bool = True,
    ) -> None:
        for name, value in (("chunk_aware", chunk_aware), ("carry_tile_pages", carry_tile_pages)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
        # The plain pipeline validates the options and is the naive per-chunk path.
        self._plain = SparsePrefillPipeline(
            config, strategy=strategy, correction=correction, backend=backend, check_index=check_index
        )
        self.config: SelectionConfig = self._plain.config
        self.strategy: str = self._plain.strategy
        self.correction: bool = self._plain.correction
        self.backend: AttentionBackend = self._plain.backend
        self.chunk_aware = chunk_aware
        self.carry_tile_pages = carry_tile_pages

    def __repr__(self) -> str:
        return (
            f"ChunkedPrefillPipeline(strategy={self.strategy!r}, correction={self.correction}, "
            f"backend={self.backend.name!r}, chunk_aware={self.chunk_aware}, carry_tile_pages={self.carry_tile_pages}, "
            f"config={self.config!r})"
        )

    def new_state(self, *, prompt_len: int | None = None, prefill_start: int = 0) -> ChunkedPrefillState:
        """A fresh per-request state for this pipeline's block size.

        Args:
            prompt_len: KV length once the whole prompt is prefilled (cached prefix included), if known.
            prefill_start: KV position of the first query of the whole prefill.

        Returns:
            The :class:`ChunkedPrefillState`.
        """
        return ChunkedPrefillState(
            prompt_len=prompt_len, prefill_start=prefill_start, block_size=self.config.block_size
        )

    # ------------------------------------------------------------------ one chunk
    def run_chunk(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        states: Sequence[ChunkedPrefillState] | None = None,
        *,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
    ) -> ChunkResult:
        """Prefill one chunk batch (each request's chunk on top of its cached KV).

        Args:
            q: ``(chunk_q, Hq, d)`` queries of the chunk batch.
            k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys, the chunk's keys already written.
            v_cache: paged values, same shape as ``k_cache``.
            batch: the chunk batch (``seqlens_k`` = KV length after the chunk, prefix included).
            states: one :class:`ChunkedPrefillState` per request of ``batch``, in batch order;
                required in chunk-aware mode, ignored otherwise.
            q_descale: ``(B, Hkv) float32`` FP8 query descales.
            k_descale: FP8 key descales.
            v_descale: FP8 value descales.

        Returns:
            The :class:`ChunkResult`.

        Raises:
            TypeError, ValueError: invalid inputs (named, with shape and dtype), missing or
                mismatched states, or a chunk outside its state's prefill.
        """
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        if not self.chunk_aware:
            result = self._plain(q, k_cache, v_cache, batch, **descales)
            pooled = sum(num_key_blocks(k, self.config.block_size) for k in batch.host.seqlens_k)
            group = q.shape[1] // k_cache.shape[2]
            dense = sum(
                dense_tile_count(num_query_tiles(n, group, self.config.tile_size), kv, self.config)
                for n, kv in zip(batch.host.q_lens, batch.host.seqlens_k)
            )
            return ChunkResult(result, batch, pooled if result.statistics is not None else 0, dense)
        if states is None:
            raise ValueError("states are required in chunk-aware mode: one ChunkedPrefillState per request")
        states = list(states)
        shapes = validate_prefill_inputs(q, k_cache, v_cache, batch, **descales)
        clock = StageClock(q.device)
        clock.mark("start")
        check_chunk_states(states, batch, self.config.block_size)
        statistics: BlockStatistics | None = None
        pooled = 0
        # Small pages: the request's K/V in tile pages, each chunk copying only what it adds (the backend's
        # per-call rule otherwise); allocated first so that the pooling launch fills them when it can.
        carries = self.carry_tile_pages and reserve_tile_pages(self.backend, q, k_cache, batch, states)
        tiles_copied = False
        if self.correction or self.strategy != DENSE_STRATEGY:
            statistics, pooled, tiles_copied = pool_chunk(
                states,
                k_cache,
                v_cache if self.correction else None,
                batch,
                block_size=self.config.block_size,
                k_descale=k_descale,
                v_descale=v_descale if self.correction else None,
                use_triton=use_triton_index(q),
                copy_tile_pages=carries and fused_tile_copy(),
            )
        index, dense = select_chunk_blocks(
            q,
            k_cache,
            batch,
            statistics,
            states,
            config=self.config,
            strategy=self.strategy,
            q_descale=q_descale,
            k_descale=k_descale,
            inputs_validated=True,
        )
        if not self._plain.check_index and is_builtin_strategy(self.strategy):
            # Built here from this chunk batch (a built-in strategy, or the dense rule): no device re-check.
            index.assume_compatible(batch, shapes.group)
        # The rest of the carried copy when the pooling could not make it: counted with the index stage, as
        # the pipeline's copy made while pooling.
        tile_copies = (
            carried_tile_copies(self.backend, q, k_cache, v_cache, batch, states, copied=tiles_copied)
            if carries
            else None
        )
        clock.mark("index")
        plan = None
        if self.correction:
            derives_todo = getattr(self.backend, "derives_todo", False)
            plan = CorrectionPlan(statistics) if derives_todo else build_correction_plan(index, statistics, batch)
        clock.mark("correction")
        copies = {"tile_copies": tile_copies} if tile_copies is not None else {}
        out = self.backend.run(
            q,
            k_cache,
            v_cache,
            batch,
            index,
            plan,
            softmax_scale=self.config.scale_for(shapes.head_dim),
            **descales,
            **copies,
        )
        release_finished_tile_pages(states)
        clock.mark("attention")
        result = PrefillResult(out=out, index=index, plan=plan, statistics=statistics, clock=clock)
        return ChunkResult(result, batch, pooled, dense)

    # ------------------------------------------------------------ a whole prefill
    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        *,
        chunk_size: int,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
    ) -> ChunkedPrefillResult:
        """Prefill a whole batch in chunks of ``chunk_size`` queries per request.

        Chunk ``i`` holds queries ``i * chunk_size ..`` of every request that has
        them, on top of the request's prefix and earlier chunks; the states are
        created here with each request's whole-prompt length (``seqlens_k``) and
        prefill start (its prefix). The cache must already hold the whole
        prompt's KV: a chunk never reads past its own ``seqlens_k``.

        Args:
            q: ``(total_q, Hq, d)`` queries of the whole batch.
            k_cache: paged keys of the whole prompts.
            v_cache: paged values.
            batch: the whole (unchunked) batch.
            chunk_size: queries per chunk and request (>= 1).
            q_descale: ``(B, Hkv) float32`` FP8 query descales of the whole batch.
            k_descale: FP8 key descales.
            v_descale: FP8 value descales.

        Returns:
            The :class:`ChunkedPrefillResult`.

        Raises:
            TypeError: ``chunk_size`` is not an int; invalid tensors.
            ValueError: ``chunk_size < 1``; inputs inconsistent with ``batch``.
        """
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__} {chunk_size!r}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        validate_prefill_inputs(
            q, k_cache, v_cache, batch, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
        )
        host = batch.host
        q_lens, prefixes, cu = host.q_lens, host.prefix, host.cu_seqlens_q
        states = [self.new_state(prompt_len=kv, prefill_start=p) for kv, p in zip(host.seqlens_k, prefixes)]
        num_chunks = max((-(-n // chunk_size) for n in q_lens), default=0)
        chunks = []
        for i in range(num_chunks):
            begin = i * chunk_size
            active = [b for b, n in enumerate(q_lens) if n > begin]
            lens = [min(chunk_size, q_lens[b] - begin) for b in active]
            kv_lens = [prefixes[b] + begin + n for b, n in zip(active, lens)]
            rows = tuple((cu[b] + begin, cu[b] + begin + n) for b, n in zip(active, lens))
            whole = len(active) == batch.num_requests
            picked = device_ints(active, batch.device, dtype=torch.long) if not whole else None
            page_table = batch.page_table if whole else batch.page_table[picked].contiguous()
            chunk_batch = batch_from_host(
                lens, kv_lens, page_table, page_size=batch.page_size, num_pages=batch.num_pages
            )
            q_chunk = q[rows[0][0] : rows[0][1]] if len(rows) == 1 else torch.cat([q[a:z] for a, z in rows])
            scales = {
                name: (None if s is None else s if whole else s[picked].contiguous())
                for name, s in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
            }
            chunk = self.run_chunk(q_chunk, k_cache, v_cache, chunk_batch, [states[b] for b in active], **scales)
            chunks.append(
                ChunkResult(chunk.result, chunk_batch, chunk.pooled_blocks, chunk.dense_tiles, tuple(active), rows)
            )
        return ChunkedPrefillResult(
            chunks=tuple(chunks),
            batch=batch,
            chunk_size=chunk_size,
            out_shape=(q.shape[0], q.shape[1], q.shape[2]),
            out_dtype=output_dtype(q.dtype),
        )
