"""fpv2 block-sparse prefill attention as an attention backend of unmodified SGLang.

:class:`Fpv2AttnBackend` subclasses SGLang's own ``AttentionBackend`` and is
added to SGLang's backend registry by
:func:`fpv2.serving.adapters.sglang_plugin.register_sglang_backend` (or the
``sglang.srt.plugins`` entry point), so it is selected like a built-in one::

    sglang serve --model-path ... \\
        --prefill-attention-backend fpv2 --decode-attention-backend fa3

SGLang then composes its ``HybridAttnBackend``: extend (prefill, chunked
prefill, mixed) batches run here, decode batches on the dense decode backend.
This backend is prefill-only and refuses decode with a message saying so.

Per forward, :meth:`Fpv2AttnBackend.init_forward_metadata` builds one
:class:`~fpv2.kernel.PagedPrefillBatch` from the ``ForwardBatch`` and
``req_to_token`` (any page size, cached prefixes included) that every layer
shares. Per layer, :meth:`Fpv2AttnBackend.forward_extend` writes the new K/V
into SGLang's KV pool through the pool's own ``set_kv_buffer`` (as SGLang's
backends do), views the layer's pool buffers as the fpv2 paged cache and runs
:class:`~fpv2.serving.SparsePrefillPipeline`. Everything is sized from the
layer's local head counts (``tp_q_head_num``, ``tp_k_head_num``), so under
tensor parallelism each rank attends over its own heads.

Chunked prefill: a forward that holds a chunk of a longer prompt (its KV after
the chunk short of ``orig_seq_lens``), or the next chunk of one, runs
:meth:`fpv2.serving.ChunkedPrefillPipeline.run_chunk` with one
:class:`~fpv2.serving.ChunkedPrefillState` per request and layer, kept between
forwards by a :class:`~fpv2.serving.chunk_state_registry.ChunkStateRegistry`
keyed by SGLang's request id. Each chunk then pools only the key blocks it adds
and keeps the whole prompt's dense fallbacks (a dense last tile in the prompt's
last chunk only), so a chunked prompt gets the unchunked call's selection.
Other forwards run :class:`~fpv2.serving.SparsePrefillPipeline` per call.
``chunk_aware=False`` (``FPV2_CHUNK_AWARE=0``) runs every forward per call.

Options (selection parameters, strategy, correction, fpv2 attention backend,
validation) come from :class:`~fpv2.serving.adapters.sglang_options.SGLangBackendOptions`,
by default read from ``FPV2_*`` environment variables in each rank.

Not supported (refused with ``NotImplementedError`` naming the feature):
decode, speculative verify/draft, dLLM and split-prefill modes, encoder-decoder
and cross attention, non-causal (encoder-only) layers, sliding-window or
chunked-local (iRoPE) layers, logit soft-capping, ``qk_head_dim != v_head_dim``,
MLA models, quantized or FP8 KV caches under non-FP8 queries, and extra
attention kwargs (e.g. attention sinks). CUDA-graph capture of this backend is
refused; SGLang's piecewise prefill graphs run attention eagerly and are not
affected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from fpv2.kernel.contracts import SUPPORTED_HEAD_DIMS

from ..chunk_state_registry import ChunkStateRegistry
from ..chunked import ChunkedPrefillPipeline
from ..pipeline import PrefillResult, SparsePrefillPipeline
from .sglang_kv_view import paged_cache_view
from .sglang_metadata import SGLangPrefillMetadata, build_prefill_metadata, chunk_requests_of
from .sglang_options import SGLangBackendOptions

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

#: Forward modes this backend serves: plain extend and chunked-prefill mixed batches.
SUPPORTED_FORWARD_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED)

#: Why decode is refused, and what to run instead.
DECODE_REFUSAL = (
    "the fpv2 SGLang attention backend is prefill-only and does not run decode; select it for prefill only and "
    "keep decode on a dense backend, e.g. --prefill-attention-backend fpv2 --decode-attention-backend fa3 "
    "(or flashinfer, triton, ...)"
)

#: Called after each layer's attention with ``(layer_id, metadata, result)`` (diagnostics, tests).
ResultHook = Callable[[int, SGLangPrefillMetadata, PrefillResult], None]


class Fpv2AttnBackend(AttentionBackend):
    """SGLang attention backend running extend batches through the fpv2 sparse prefill pipeline.

    Args:
        model_runner: SGLang's ``ModelRunner`` (or an object with its
            ``req_to_token_pool``, ``token_to_kv_pool`` and ``device``).
        options: selection and runtime options (None: read ``FPV2_*``
            environment variables, see :mod:`fpv2.serving.adapters.sglang_options`).

    Attributes:
        options: the options in force.
        result_hook: optional :data:`ResultHook` called after every layer.
        chunk_aware: whether chunked prefills run chunk-aware (``options.chunk_aware``).
        chunk_states: the per-request, per-layer states of chunked prefills in flight.

    Raises:
        TypeError: ``options`` is not a :class:`SGLangBackendOptions`.
        ValueError: an MLA model, or options naming an unknown strategy or backend.
        RuntimeError: the named fpv2 attention backend is not available here.
    """

    def __init__(self, model_runner: object, options: SGLangBackendOptions | None = None) -> None:
        super().__init__()
        if options is None:
            options = SGLangBackendOptions.from_env()
        if not isinstance(options, SGLangBackendOptions):
            raise TypeError(f"options must be a SGLangBackendOptions; got {type(options).__name__}")
        if getattr(model_runner, "use_mla_backend", False):
            raise ValueError("the fpv2 SGLang backend serves MHA/GQA models; this model uses MLA")
        self.options = options
        self.device = getattr(model_runner, "device", None)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
        self.page_size = int(self.token_to_kv_pool.page_size)
        self.forward_metadata: SGLangPrefillMetadata | None = None
        self.result_hook: ResultHook | None = None
        self._pipelines: dict[float, SparsePrefillPipeline] = {}
        self._chunked_pipelines: dict[float, ChunkedPrefillPipeline] = {}
        self.chunk_states = ChunkStateRegistry(
            budget_bytes=options.chunk_state_mb << 20, block_size=options.selection.block_size
        )
        # Build one pipeline now: an unknown strategy or unavailable backend fails at startup, not mid-request.
        self._pipeline_for(1.0)
        self.chunk_aware = options.chunk_aware

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build the forward's :class:`SGLangPrefillMetadata`, shared by every layer.

        Args:
            forward_batch: the forward's batch (extend or mixed mode; idle is a no-op).

        Raises:
            NotImplementedError: decode or another unsupported forward mode, or an
                encoder-decoder batch.
            ValueError: inconsistent batch fields (with ``options.validate``).
        """
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
            return
        if mode.is_decode():
            raise NotImplementedError(DECODE_REFUSAL)
        if mode not in SUPPORTED_FORWARD_MODES:
            raise NotImplementedError(
                f"the fpv2 SGLang backend runs EXTEND and MIXED forwards only; got {mode.name} (speculative "
                f"verify/draft, dLLM and split-prefill batches need masks or state fpv2 does not take)"
            )
        if getattr(forward_batch, "encoder_lens", None) is not None:
            raise NotImplementedError("the fpv2 SGLang backend does not serve encoder-decoder models")
        metadata = build_prefill_metadata(
            forward_batch,
            self.req_to_token_pool.req_to_token,
            page_size=self.page_size,
            num_pages=self._num_cache_pages(),
            validate=self.options.validate,
        )
        requests = chunk_requests_of(forward_batch) if self.chunk_aware else None
        if requests is not None and len(requests) != metadata.batch.num_requests:
            requests = None  # ids for fewer rows than the batch's tensors (a padded batch): per call
        if requests is not None and self.chunk_states.begin_forward(requests):
            metadata = dataclasses.replace(metadata, chunk_requests=requests)
        self.forward_metadata = metadata

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """Same as :meth:`init_forward_metadata` (all of it is host-side work).

        Args:
            forward_batch: the forward's batch.
            in_capture: whether a graph capture follows (ignored).
        """
        self.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Refuse CUDA-graph capture: the backend runs eager extend forwards only.

        Args:
            max_bs: largest captured batch.
            max_num_tokens: largest captured token count.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "the fpv2 SGLang backend cannot be captured in a CUDA graph (prefill-only, eager); " + DECODE_REFUSAL
        )

    # ------------------------------------------------------------------- forward
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: object,
    ) -> torch.Tensor:
        """Refuse decode.

        Args:
            q: decode queries.
            k: new keys.
            v: new values.
            layer: the attention layer.
            forward_batch: the decode batch.
            save_kv_cache: whether to write k/v.
            **kwargs: extra attention arguments.

        Raises:
            NotImplementedError: always (decode stays on a dense backend).
        """
        raise NotImplementedError(DECODE_REFUSAL)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: object,
    ) -> torch.Tensor:
        """Write the layer's new K/V into the pool, then run fpv2 over the layer's paged cache.

        Args:
            q: ``(tokens, Hq * d)`` or ``(tokens, Hq, d)`` queries, ``Hq = layer.tp_q_head_num``.
            k: ``(tokens, Hkv, d)`` new keys (``Hkv = layer.tp_k_head_num``), or None.
            v: new values like ``k``, or None.
            layer: the ``RadixAttention`` layer (local head counts, scaling, layer id).
            forward_batch: the batch :meth:`init_forward_metadata` was called with.
            save_kv_cache: write ``k``/``v`` at ``out_cache_loc`` first.
            **kwargs: extra attention arguments; any non-None one is refused.

        Returns:
            ``(tokens, Hq * d)`` attention output in the dtype of ``q``.

        Raises:
            RuntimeError: no metadata was built for this forward.
            NotImplementedError: a layer feature or argument fpv2 does not support.
            TypeError, ValueError: shapes or dtypes inconsistent with the layer,
                the pool or the batch (named in the message).
        """
        metadata = self.forward_metadata
        if metadata is None:
            raise RuntimeError("Fpv2AttnBackend.forward_extend called before init_forward_metadata for this forward")
        _check_layer(layer)
        extra = sorted(name for name, value in kwargs.items() if value is not None)
        if extra:
            raise NotImplementedError(
                f"the fpv2 SGLang backend takes no extra attention arguments; layer {layer.layer_id} passed "
                f"{', '.join(extra)}"
            )
        num_q_heads, num_kv_heads, head_dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        if q.numel() % (num_q_heads * head_dim) != 0:
            raise ValueError(
                f"q of shape {tuple(q.shape)} dtype {q.dtype} does not hold rows of tp_q_head_num={num_q_heads} "
                f"heads x head_dim={head_dim} (layer {layer.layer_id})"
            )
        q_heads = q.reshape(-1, num_q_heads, head_dim)
        self._check_pool_dtype(q_heads.dtype, layer)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v)
        # Read the buffers after the write: a pool may hand out a copy rather than a view.
        view = {"page_size": self.page_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
        k_cache = paged_cache_view(self.token_to_kv_pool.get_key_buffer(layer.layer_id), name="key buffer", **view)
        v_cache = paged_cache_view(self.token_to_kv_pool.get_value_buffer(layer.layer_id), name="value buffer", **view)
        if metadata.chunk_requests is not None:
            states = self.chunk_states.states_for(layer.layer_id, metadata.chunk_requests)
            chunk = self._chunked_pipeline_for(layer.scaling).run_chunk(
                q_heads, k_cache, v_cache, metadata.batch, states
            )
            result = chunk.result
        else:
            result = self._pipeline_for(layer.scaling)(q_heads, k_cache, v_cache, metadata.batch)
        if self.result_hook is not None:
            self.result_hook(layer.layer_id, metadata, result)
        return result.out.reshape(q_heads.shape[0], num_q_heads * head_dim)

    # ------------------------------------------------------------------- helpers
    def _pipeline_for(self, scale: float) -> SparsePrefillPipeline:
        """The pipeline for one softmax scale (layers of a model share one, so this is built once)."""
        key = float(scale)
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            pipeline = SparsePrefillPipeline(
                self.options.selection_for_scale(key),
                strategy=self.options.strategy,
                correction=self.options.correction,
                backend=self.options.backend,
            )
            self._pipelines[key] = pipeline
        return pipeline

    def _chunked_pipeline_for(self, scale: float) -> ChunkedPrefillPipeline:
        """The chunk-aware pipeline for one softmax scale; no carried tile pages (one per layer would not fit)."""
        key = float(scale)
        pipeline = self._chunked_pipelines.get(key)
        if pipeline is None:
            plain = self._pipeline_for(key)
            pipeline = ChunkedPrefillPipeline(
                plain.config,
                strategy=plain.strategy,
                correction=plain.correction,
                backend=plain.backend,
                carry_tile_pages=False,
            )
            self._chunked_pipelines[key] = pipeline
        return pipeline

    def _num_cache_pages(self) -> int:
        """Pages of every layer's paged view: the pool's slots (its padded page included) over the page size."""
        pool = self.token_to_kv_pool
        return (int(pool.size) + self.page_size) // self.page_size

    def _check_pool_dtype(self, dtype: torch.dtype, layer: RadixAttention) -> None:
        """Refuse, before anything is written, a KV pool whose elements fpv2 cannot read beside ``dtype`` queries."""
        pool = self.token_to_kv_pool
        if getattr(pool, "is_quantized_kv_cache", False):
            raise NotImplementedError("the fpv2 SGLang backend does not read quantized (e.g. FP4) KV caches")
        pool_dtype = getattr(pool, "dtype", dtype)
        if pool_dtype != dtype:
            raise NotImplementedError(
                f"the fpv2 SGLang backend needs the KV cache in the query dtype; layer {layer.layer_id} has "
                f"queries in {dtype} and a KV cache in {pool_dtype} (use --kv-cache-dtype auto)"
            )


def _check_layer(layer: RadixAttention) -> None:
    """Refuse layer features the fpv2 pipeline does not implement (causal full attention only)."""
    lid = layer.layer_id
    if layer.qk_head_dim != layer.v_head_dim:
        raise NotImplementedError(
            f"layer {lid}: qk_head_dim={layer.qk_head_dim} != v_head_dim={layer.v_head_dim} is not supported by fpv2"
        )
    if layer.qk_head_dim not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(
            f"layer {lid}: head dim {layer.qk_head_dim} is not one of fpv2's head dims {SUPPORTED_HEAD_DIMS}"
        )
    if layer.tp_k_head_num < 1 or layer.tp_q_head_num % layer.tp_k_head_num != 0:
        raise ValueError(
            f"layer {lid}: tp_q_head_num={layer.tp_q_head_num} is not a multiple of tp_k_head_num={layer.tp_k_head_num}"
        )
    if layer.is_cross_attention:
        raise NotImplementedError(f"layer {lid}: cross attention is not supported by fpv2")
    if layer.attn_type != AttentionType.DECODER:
        raise NotImplementedError(f"layer {lid}: {layer.attn_type.value} (non-causal) attention is not supported")
    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise NotImplementedError(
            f"layer {lid}: sliding-window attention (window {layer.sliding_window_size}) is not supported by fpv2"
        )
    if getattr(layer, "use_irope", False):
        raise NotImplementedError(f"layer {lid}: chunked local attention (iRoPE) is not supported by fpv2")
    if layer.logit_cap and layer.logit_cap > 0:
        raise NotImplementedError(f"layer {lid}: logit soft-capping (logit_cap={layer.logit_cap}) is not supported")
