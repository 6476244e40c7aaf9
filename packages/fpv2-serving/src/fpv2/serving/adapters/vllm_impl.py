"""The attention impl of the fpv2 vLLM backend: prefill rows through fpv2, decode rows through vLLM.

One instance per attention layer (vLLM constructs it with the layer's local
heads, so under tensor parallelism each rank runs on its own heads). It owns

* a :class:`~fpv2.serving.SparsePrefillPipeline` whose logit scale is the
  layer's ``scale``, with the selection parameters of
  :mod:`.vllm_options`;
* a delegate impl of vLLM's dense decode backend (:mod:`.vllm_decode`),
  constructed with the same arguments.

``do_kv_cache_update`` (called by vLLM's attention layer before ``forward``)
stores the step's keys and values with vLLM's own op through the delegate on
a GPU, and with the pure-PyTorch equivalent :func:`.vllm_kv_cache.write_kv_cache`
on CPU tensors, where vLLM's ops do not run. ``forward`` then runs
:func:`.vllm_forward.forward_split_batch`.

Refused at construction (``NotImplementedError``, naming the argument):
ALiBi, sliding windows, logit soft-capping, attention sinks and other extra
arguments, non-decoder attention, quantised KV caches, head sizes other than
64/128/256; fused output quantisation is refused in ``forward``. The backend
class declares the same limits, so vLLM's selector rejects such models
before an impl is built.

Imports vLLM (``vllm.v1.attention``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionLayer, AttentionType

from fpv2.kernel.contracts import SUPPORTED_HEAD_DIMS

from ..pipeline import SparsePrefillPipeline
from .vllm_decode import check_decode_device, decode_backend_name, resolve_decode_backend
from .vllm_forward import PrefillHook, forward_split_batch
from .vllm_kv_cache import write_kv_cache
from .vllm_metadata import Fpv2VllmMetadata
from .vllm_options import VllmAdapterOptions, load_options

#: vLLM ``kv_cache_dtype`` strings of unquantised caches (the only ones fpv2 reads here).
UNQUANTISED_KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")


class Fpv2AttentionImpl(AttentionImpl[Fpv2VllmMetadata]):
    """fpv2 sparse prefill + vLLM dense decode for one attention layer.

    Args:
        num_heads: query heads of this rank.
        head_size: ``d`` (64, 128 or 256).
        scale: the layer's logit scale (used by fpv2 and the decode delegate).
        num_kv_heads: KV heads of this rank (None: ``num_heads``).
        alibi_slopes: must be None.
        sliding_window: must be None.
        kv_cache_dtype: ``"auto"``, ``"float16"`` or ``"bfloat16"``.
        logits_soft_cap: must be None or 0.
        attn_type: must be decoder attention.
        kv_sharing_target_layer_name: layer whose cache this one reads (vLLM then
            skips this layer's KV write).
        options: adapter options (None: :func:`.vllm_options.load_options`).
        **extra: further per-model arguments vLLM may pass (e.g. ``sinks``); any
            value other than None is refused.

    Raises:
        NotImplementedError: an unsupported feature is asked for (named).
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        *,
        options: VllmAdapterOptions | None = None,
        **extra: Any,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _refuse_unsupported(
            head_size=head_size,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap,
            attn_type=attn_type,
            extra=extra,
        )
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.options = load_options() if options is None else options
        # The model's scale is the logit scale of the index and the attention alike.
        config = dataclasses.replace(self.options.config, softmax_scale=self.scale)
        self.pipeline = SparsePrefillPipeline(
            config, strategy=self.options.strategy, correction=self.options.correction, backend=self.options.backend
        )
        self.decode_backend_name = decode_backend_name(self.options.decode_backend)
        decode_backend = resolve_decode_backend(self.options.decode_backend)
        self.decode_impl = decode_backend.get_impl_cls()(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            None,
            None,
            kv_cache_dtype,
            None,
            attn_type,
            kv_sharing_target_layer_name,
        )
        #: Called with each pipeline result (None: nothing is recorded).
        self.prefill_hook: PrefillHook | None = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Forward vLLM's post-load hook to the decode delegate.

        Args:
            act_dtype: the model's activation dtype.
        """
        self.decode_impl.process_weights_after_loading(act_dtype)

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store this step's keys and values at ``slot_mapping`` (vLLM's ``reshape_and_cache`` contract).

        Args:
            layer: the vLLM attention layer (its ``_k_scale``/``_v_scale`` reach vLLM's op).
            key: ``(num_tokens, Hkv, d)`` new keys.
            value: ``(num_tokens, Hkv, d)`` new values.
            kv_cache: the layer's cache, ``(num_blocks, Hkv, block_size, 2 * d)``.
            slot_mapping: ``(n,)`` slots; negative ones and rows past ``n`` are skipped.
        """
        if key.device.type == "cpu":
            # vLLM's cache ops are CUDA/Triton kernels; on CPU tensors the PyTorch equivalent.
            write_kv_cache(key, value, kv_cache, slot_mapping)
            return
        self.decode_impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: Fpv2VllmMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one step (the cache already holds this step's keys and values).

        Args:
            layer: the vLLM attention layer.
            query: ``(num_tokens, Hq, d)`` queries.
            key: ``(num_tokens, Hkv, d)`` new keys (already cached; passed on to the decode delegate).
            value: new values, likewise.
            kv_cache: the layer's cache.
            attn_metadata: the step's metadata; None during vLLM's profiling run.
            output: ``(num_tokens, Hq, d)`` written in place.
            output_scale: must be None (no fused output quantisation).
            output_block_scale: must be None.

        Returns:
            ``output``.

        Raises:
            NotImplementedError: fused output quantisation was asked for.
            RuntimeError: decode rows on CPU tensors (vLLM's dense kernels need a GPU).
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantisation is not supported by the fpv2 backend")
        if attn_metadata is None:
            # vLLM's profiling run: no metadata, output contents are irrelevant.
            return output.fill_(0)
        nd = attn_metadata.split.num_decode_tokens

        def decode(q_rows: torch.Tensor, out_rows: torch.Tensor) -> None:
            check_decode_device(self.decode_backend_name, q_rows.device)
            self.decode_impl.forward(
                layer,
                q_rows,
                None if key is None else key[:nd],
                None if value is None else value[:nd],
                kv_cache,
                attn_metadata.decode,
                out_rows,
            )

        return forward_split_batch(
            query,
            kv_cache,
            attn_metadata,
            output,
            head_size=self.head_size,
            pipeline=self.pipeline,
            decode=decode,
            prefill_hook=self.prefill_hook,
        )


def _refuse_unsupported(
    *,
    head_size: int,
    alibi_slopes: object,
    sliding_window: object,
    kv_cache_dtype: str,
    logits_soft_cap: float | None,
    attn_type: str,
    extra: dict[str, Any],
) -> None:
    """Raise ``NotImplementedError`` for the first feature the fpv2 backend does not serve."""
    if head_size not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head_size must be one of {SUPPORTED_HEAD_DIMS} for fpv2; got {head_size}")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: ALiBi is not supported by the fpv2 backend")
    if sliding_window is not None:
        raise NotImplementedError(f"sliding_window={sliding_window}: sliding windows are not supported by fpv2")
    if kv_cache_dtype not in UNQUANTISED_KV_CACHE_DTYPES:
        raise NotImplementedError(
            f"kv_cache_dtype={kv_cache_dtype!r}: fpv2 reads unquantised caches only {UNQUANTISED_KV_CACHE_DTYPES}"
        )
    if logits_soft_cap:
        raise NotImplementedError(f"logits_soft_cap={logits_soft_cap}: soft-capping is not supported by fpv2")
    if attn_type != AttentionType.DECODER:
        raise NotImplementedError(f"attn_type={attn_type!r}: fpv2 serves causal decoder attention only")
    given = {name: value for name, value in extra.items() if value is not None and value is not False}
    if given:
        raise NotImplementedError(f"unsupported attention arguments for fpv2: {sorted(given)}")
