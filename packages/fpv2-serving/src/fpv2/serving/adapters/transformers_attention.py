"""``attn_implementation="fpv2"`` for Hugging Face transformers: sparse prefill, dense decode.

Usage::

    from fpv2.serving.adapters.transformers_attention import register_fpv2_attention

    register_fpv2_attention()  # once per process
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fpv2")

What is sparse: every prefill call of a causal attention layer, i.e. ``q_len > 1``
queries whose keys are the same ``q_len`` tokens (plain prefill) or a cached
prefix plus them (prefill on top of a cache: bottom-right causal), for every
row of a padding-free batch. It runs :class:`fpv2.serving.SparsePrefillPipeline`
(pooling, block selection, mean correction, block-sparse attention) on the
layer's K/V in place: they are viewed as a paged cache (pages of up to 128
tokens, see :mod:`.transformers_kv_view`) and the model's K/V heads are used as
they are (PackGQA; no ``repeat_kv``). The model's ``scaling`` is the logit scale.

What falls back to transformers' own sdpa function (dense, exact), counted in
:class:`~.transformers_stats.Fpv2AttentionStats` and logged once per reason:

- decode steps (``q_len == 1``) -- by design;
- padding, packed sequences or any mask other than the causal one (see
  :mod:`.transformers_mask`), and non-causal (encoder) attention;
- dropout, sliding windows, position biases, attention sinks, continuous
  batching's paged cache;
- dtypes other than fp16/bf16/fp32, head dims other than 64/128/256, K and V
  head dims that differ, and ``Hq`` not a multiple of ``Hkv``;
- calls that need gradients (the pipeline has no backward) and calls under
  ``torch.compile`` (the pipeline synchronises with the host).

Logit softcapping (Gemma 2) is refused with a ``ValueError``: sdpa cannot do it
either. Short prompts are not routed to sdpa here: below ``config.min_sparse_kv_len`` the
pipeline itself keeps every block (dense mode).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.contracts import SUPPORTED_HEAD_DIMS

from ..backends import AUTO, AttentionBackend
from ..pipeline import PrefillResult, SparsePrefillPipeline
from .transformers_kv_view import dense_kv_as_pages
from .transformers_mask import causal_key_length, fpv2_mask
from .transformers_stats import DECODE, Fpv2AttentionStats

logger = logging.getLogger(__name__)

#: Activation dtypes the adapter hands to the pipeline.
PIPELINE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Names transformers already uses for its own implementations (never overwritten).
_RESERVED_NAMES = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")

#: A hook sees each pipeline call: ``hook(module, batch, result)``.
PrefillHook = Callable[[torch.nn.Module, PagedPrefillBatch, PrefillResult], None]


class Fpv2Attention:
    """The attention function registered as ``attn_implementation=<name>`` (see the module docstring).

    Args:
        config: selection parameters (None: :class:`fpv2.index.SelectionConfig` defaults).
            Its ``softmax_scale`` is used only when the model passes no ``scaling``.
        strategy: selection strategy; ``"dense"`` keeps every visible block.
        correction: add the mean correction for pruned blocks.
        backend: attention backend name or object (``"auto"``: the best available;
            CPU tensors then use ``"reference"``).
        track_density: record each pipeline call's block density in :attr:`stats`.

    Attributes:
        stats: the :class:`~.transformers_stats.Fpv2AttentionStats` of this function.

    Raises:
        TypeError, ValueError, RuntimeError: as :class:`SparsePrefillPipeline`
            (bad config, unknown strategy or backend, backend unavailable).
    """

    def __init__(
        self,
        config: SelectionConfig | None = None,
        *,
        strategy: str = "max_threshold",
        correction: bool = True,
        backend: str | AttentionBackend = AUTO,
        track_density: bool = False,
    ) -> None:
        # Built now so that bad settings fail at registration, not inside a model's forward.
        self.pipeline = SparsePrefillPipeline(config, strategy=strategy, correction=correction, backend=backend)
        self.requested_backend = backend
        self.stats = Fpv2AttentionStats(track_density=track_density)
        self._pipelines: dict[tuple[str, float | None], SparsePrefillPipeline] = {}
        self._hooks: list[PrefillHook] = []
        self._said: set[str] = set()

    @property
    def settings(self) -> tuple:
        """``(config, strategy, correction, requested backend, track_density)``; equal settings, same function."""
        p = self.pipeline
        return (p.config, p.strategy, p.correction, self.requested_backend, self.stats.track_density)

    def __repr__(self) -> str:
        return f"Fpv2Attention({self.pipeline!r})"

    def add_prefill_hook(self, hook: PrefillHook) -> Callable[[], None]:
        """Call ``hook(module, batch, result)`` after every pipeline call (e.g. to inspect the index).

        Args:
            hook: the callable.

        Returns:
            A function that removes the hook.

        Raises:
            TypeError: ``hook`` is not callable.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable; got {type(hook).__name__}")
        self._hooks.append(hook)
        return lambda: self._hooks.remove(hook) if hook in self._hooks else None

    # ------------------------------------------------------------------ call
    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """transformers' attention interface: the pipeline for prefill, sdpa otherwise.

        Args:
            module: the attention layer (``is_causal``, ``layer_idx`` are read if present).
            query: ``(B, Hq, q_len, d)`` queries.
            key: ``(B, Hkv, kv_len, d)`` keys (cache included).
            value: ``(B, Hkv, kv_len, d)`` values.
            attention_mask: what :func:`~.transformers_mask.fpv2_mask` made.
            scaling: logit scale (None: the config's, else ``1/sqrt(d)``).
            dropout: attention dropout probability (nonzero: sdpa).
            **kwargs: the other keywords transformers passes (``sliding_window``,
                ``softcap``, ``is_causal``, ...), forwarded to sdpa on fallback.

        Returns:
            ``(attn_output (B, q_len, Hq, d), None)``.

        Raises:
            ValueError: logit softcapping was asked for (``softcap``).
        """
        route = self._route(module, query, key, value, attention_mask, dropout, kwargs)
        if isinstance(route, str):
            return self._fallback(route, module, query, key, value, attention_mask, scaling, dropout, kwargs)
        batch_size, num_q_heads, q_len, head_dim = query.shape
        view = dense_kv_as_pages(key, value, q_len, route)
        # (B, Hq, q, d) -> (B*q, Hq, d): a view for B == 1, one copy otherwise.
        q = query.transpose(1, 2).reshape(batch_size * q_len, num_q_heads, head_dim)
        pipeline = self._pipeline_for(query.device, scaling)
        result = pipeline(q, view.k_cache, view.v_cache, view.batch)
        self.stats.pipeline_calls += 1
        self.stats.pipeline_tokens += batch_size * q_len
        if self.stats.track_density:
            self.stats.densities.append(result.index.density(view.batch))
        for hook in list(self._hooks):
            hook(module, view.batch, result)
        return result.out.view(batch_size, q_len, num_q_heads, head_dim), None

    def _route(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        dropout: float,
        kwargs: dict[str, Any],
    ) -> int | str:
        """The KV length the pipeline serves, or the reason it cannot serve the call."""
        if kwargs.get("softcap") is not None:
            # sdpa, the fallback, cannot do it either (transformers >= 5.23 refuses it, older ones ignore it).
            raise ValueError(
                f"attn_implementation 'fpv2' does not support logit softcapping (softcap={kwargs['softcap']!r}) and "
                "neither does its dense fallback, sdpa; use attn_implementation='eager' for this model"
            )
        if kwargs.get("cache") is not None:
            return "continuous batching (paged cache)"
        if torch.compiler.is_compiling():
            return "torch.compile"
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            return f"unexpected rank (query {tuple(query.shape)}, key {tuple(key.shape)})"
        q_len, kv_slots = query.shape[2], key.shape[2]
        if q_len == 1:
            return DECODE
        if dropout:
            return "dropout"
        if kwargs.get("sliding_window"):
            return "sliding window"
        for name, what in (("position_bias", "position bias"), ("s_aux", "attention sinks")):
            if kwargs.get(name) is not None:
                return what
        is_causal = kwargs.get("is_causal")
        if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
            return "non-causal attention"
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            return "gradients required (the fpv2 pipeline has no backward)"
        if query.dtype not in PIPELINE_DTYPES or not (query.dtype == key.dtype == value.dtype):
            return f"dtype (query {query.dtype}, key {key.dtype}, value {value.dtype})"
        head_dim = query.shape[3]
        if head_dim not in SUPPORTED_HEAD_DIMS or key.shape[3] != head_dim or value.shape[3] != head_dim:
            return f"head dim (query {head_dim}, key {key.shape[3]}, value {value.shape[3]}; fpv2 has 64/128/256)"
        if key.shape[1] == 0 or query.shape[1] % key.shape[1] or key.shape != value.shape:
            return f"head layout (query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)})"
        if attention_mask is None:
            if q_len == kv_slots:
                return kv_slots
            if q_len < kv_slots:
                return q_len  # sdpa's reading of no mask: an empty static cache, causal over the first q_len slots
            return f"more queries ({q_len}) than keys ({kv_slots})"
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:
            length = causal_key_length(attention_mask, q_len)
            if length is not None:
                return length
            return "attention mask with padding or a non-causal pattern"
        return f"attention mask of type {type(attention_mask).__name__}"

    def _pipeline_for(self, device: torch.device, scaling: float | None) -> SparsePrefillPipeline:
        """The pipeline for ``device`` with the model's logit scale (built once per pair)."""
        key = (device.type, None if scaling is None else float(scaling))
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            base = self.pipeline
            config = base.config if scaling is None else dataclasses.replace(base.config, softmax_scale=float(scaling))
            backend: str | AttentionBackend = base.backend
            if device.type == "cpu" and self.requested_backend == AUTO:
                backend = "reference"  # "auto" may pick a GPU backend; CPU tensors need the reference
            pipeline = SparsePrefillPipeline(
                config, strategy=base.strategy, correction=base.correction, backend=backend
            )
            self._pipelines[key] = pipeline
        return pipeline

    def _fallback(
        self,
        reason: str,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        scaling: float | None,
        dropout: float,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, None]:
        """Count, log once, and run transformers' sdpa attention on the unchanged arguments."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.stats.count_fallback(reason)
        if reason not in self._said:
            self._said.add(reason)
            level = logging.INFO if reason == DECODE else logging.WARNING
            logger.log(level, "fpv2 attention: %s -> dense sdpa (logged once per reason)", reason)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )


_REGISTERED: dict[str, Fpv2Attention] = {}


def register_fpv2_attention(
    *,
    config: SelectionConfig | None = None,
    correction: bool = True,
    backend: str | AttentionBackend = AUTO,
    name: str = "fpv2",
    strategy: str = "max_threshold",
    track_density: bool = False,
) -> None:
    """Make ``attn_implementation=name`` available to every transformers model of this process.

    Registers an :class:`Fpv2Attention` with ``transformers.AttentionInterface``
    and :func:`~.transformers_mask.fpv2_mask` with ``AttentionMaskInterface``
    under ``name``. Calling it again with the same settings changes nothing
    (the same function and counters stay registered); with other settings it
    replaces the function (models pick the new one on their next forward).

    Args:
        config: selection parameters (None: :class:`fpv2.index.SelectionConfig` defaults;
            ``min_sparse_kv_len`` keeps short prompts dense).
        correction: add the mean correction for pruned blocks.
        backend: attention backend (``"auto"``, a name or a backend object).
        name: the ``attn_implementation`` name; transformers' own names are refused.
        strategy: selection strategy (``"dense"``: the dense mode, every visible block).
        track_density: record each pipeline call's density in the stats.

    Raises:
        ImportError: transformers is not installed.
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is empty or one of transformers' own implementations.
        RuntimeError: the named backend is not available here.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {type(name).__name__}")
    if not name or name in _RESERVED_NAMES or name.startswith("paged|"):
        raise ValueError(f"name {name!r} is empty or belongs to transformers' own attention implementations")
    attention = Fpv2Attention(
        config, strategy=strategy, correction=correction, backend=backend, track_density=track_density
    )
    current = _REGISTERED.get(name)
    if current is not None and current.settings == attention.settings:
        attention = current
    _REGISTERED[name] = attention
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, fpv2_mask)


def get_fpv2_attention(name: str = "fpv2") -> Fpv2Attention:
    """The function registered under ``name`` (for its :attr:`~Fpv2Attention.stats` and hooks).

    Args:
        name: the name given to :func:`register_fpv2_attention`.

    Returns:
        The registered :class:`Fpv2Attention`.

    Raises:
        KeyError: nothing was registered under ``name``.
    """
    if name not in _REGISTERED:
        raise KeyError(f"no fpv2 attention registered as {name!r}; registered: {sorted(_REGISTERED) or 'none'}")
    return _REGISTERED[name]
