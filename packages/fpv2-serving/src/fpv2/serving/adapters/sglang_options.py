"""Options of the fpv2 SGLang prefill backend, set in code or through ``FPV2_*`` environment variables.

SGLang builds its attention backends inside each scheduler (tensor-parallel
rank) process from a registry factory that receives only the model runner, so
the backend reads its options from the environment of that process when it is
constructed, unless :func:`fpv2.serving.adapters.sglang_plugin.register_sglang_backend`
was given an explicit :class:`SGLangBackendOptions`. Environment variables set
before ``sglang serve`` starts reach every rank.

==========================  =========================================  ==================
Variable                    Meaning                                    Default
==========================  =========================================  ==================
``FPV2_ALPHA``              max-threshold ratio in (0, 1]; larger is   ``0.1``
                            sparser
``FPV2_BLOCK_SIZE``         tokens per key block (power of two)        ``128``
``FPV2_TILE_SIZE``          packed query rows per tile (power of two)  ``128``
``FPV2_SINK_TOKENS``        leading tokens always kept                 ``256``
``FPV2_WINDOW_TOKENS``      local window before each tile always kept  ``512``
``FPV2_DENSE_TAIL_TILES``   last query tiles of a request kept dense   ``1``
``FPV2_MIN_SPARSE_KV_LEN``  requests with fewer KV tokens run dense    ``8192``
``FPV2_PROBE_STRIDE``       score every n-th packed row of a tile      ``1``
``FPV2_STRATEGY``           selection strategy (``dense`` = all        ``max_threshold``
                            visible blocks)
``FPV2_CORRECTION``         mean correction for pruned blocks          ``1``
``FPV2_BACKEND``            fpv2 attention backend (``auto``,          ``auto``
                            ``hopper``, ``triton``, ``reference``)
``FPV2_VALIDATE``           check each forward's metadata on the host  ``1``
                            (one device synchronisation per forward)
``FPV2_CHUNK_AWARE``        carry each request's pooled blocks and     ``1``
                            whole-prompt dense rule across the chunks
                            of a chunked prefill
``FPV2_CHUNK_STATE_MB``     memory for carried states of requests      ``2048``
                            absent from a forward (least recently
                            used dropped first)
==========================  =========================================  ==================

The selection defaults are those of :class:`fpv2.index.SelectionConfig` (the
single source of defaults). The softmax scale is not an option: each layer's
``RadixAttention.scaling`` (the model's own) is used. Boolean variables accept
``1/true/yes/on`` and ``0/false/no/off`` (any case).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from fpv2.index import SelectionConfig

#: Prefix of every environment variable read by :meth:`SGLangBackendOptions.from_env`.
ENV_PREFIX = "FPV2_"

# SelectionConfig field -> (environment variable, parser); softmax_scale comes from the layer.
_SELECTION_VARIABLES: dict[str, tuple[str, type]] = {
    "alpha": ("FPV2_ALPHA", float),
    "block_size": ("FPV2_BLOCK_SIZE", int),
    "tile_size": ("FPV2_TILE_SIZE", int),
    "sink_tokens": ("FPV2_SINK_TOKENS", int),
    "window_tokens": ("FPV2_WINDOW_TOKENS", int),
    "dense_tail_tiles": ("FPV2_DENSE_TAIL_TILES", int),
    "min_sparse_kv_len": ("FPV2_MIN_SPARSE_KV_LEN", int),
    "probe_stride": ("FPV2_PROBE_STRIDE", int),
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class SGLangBackendOptions:
    """How the fpv2 SGLang backend selects blocks and runs attention.

    Attributes:
        selection: block-selection parameters; its ``softmax_scale`` is replaced
            by each layer's ``scaling``.
        strategy: a name from :func:`fpv2.index.available_strategies`
            (``"dense"`` keeps every visible block).
        correction: add the mean correction for pruned blocks.
        backend: fpv2 attention backend name (see :mod:`fpv2.serving.backends`).
        validate: check every forward's metadata values on the host (page ids in
            range, lengths consistent); costs one device synchronisation per
            forward, not per layer.
        chunk_aware: run the chunks of a chunked prefill through
            :class:`~fpv2.serving.ChunkedPrefillPipeline` with one state per
            request and layer (:mod:`fpv2.serving.chunk_state_registry`): each
            chunk pools only the blocks it adds, and the dense fallbacks refer
            to the whole prompt, so a chunked prompt keeps the unchunked call's
            selection. Reads ``ForwardBatch.orig_seq_lens`` (one small
            device-to-host copy per extend forward). Default True on every
            attention backend: measured faster on the Triton and the Hopper
            kernels (``benchmarks/results/2026-12-06-h100-engine-chunks-host-ahead/``,
            ``docs/serving/adapters.rst``).
        chunk_state_mb: MiB of carried states kept for requests absent from a
            forward before the least recently used are dropped.

    Raises:
        TypeError: a field has the wrong type.
    """

    selection: SelectionConfig = field(default_factory=SelectionConfig)
    strategy: str = "max_threshold"
    correction: bool = True
    backend: str = "auto"
    validate: bool = True
    chunk_aware: bool = True
    chunk_state_mb: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.selection, SelectionConfig):
            raise TypeError(
                f"SGLangBackendOptions.selection must be a fpv2.index.SelectionConfig; "
                f"got {type(self.selection).__name__}"
            )
        for name in ("strategy", "backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"SGLangBackendOptions.{name} must be a non-empty str; got {value!r}")
        for name in ("correction", "validate", "chunk_aware"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"SGLangBackendOptions.{name} must be a bool; got {type(value).__name__} {value!r}")
        if isinstance(self.chunk_state_mb, bool) or not isinstance(self.chunk_state_mb, int):
            raise TypeError(
                f"SGLangBackendOptions.chunk_state_mb must be an int; got {type(self.chunk_state_mb).__name__}"
            )
        if self.chunk_state_mb < 0:
            raise ValueError(f"SGLangBackendOptions.chunk_state_mb must be >= 0; got {self.chunk_state_mb}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SGLangBackendOptions:
        """Options from ``FPV2_*`` variables; unset variables keep their defaults.

        Args:
            environ: the variables to read (None: ``os.environ``).

        Returns:
            The options.

        Raises:
            ValueError: a variable cannot be parsed or is out of range; the
                message names the variable and its value.
        """
        env = os.environ if environ is None else environ
        selection_kwargs = {}
        for name, (variable, parse) in _SELECTION_VARIABLES.items():
            raw = env.get(variable)
            if raw is None or raw.strip() == "":
                continue
            try:
                selection_kwargs[name] = parse(raw.strip())
            except ValueError:
                raise ValueError(f"{variable}={raw!r} is not a valid {parse.__name__}") from None
        try:
            selection = SelectionConfig(**selection_kwargs)
        except (TypeError, ValueError) as exc:
            variables = [_SELECTION_VARIABLES[name][0] for name in selection_kwargs]
            names = ", ".join(f"{variable}={env[variable]!r}" for variable in variables)
            raise ValueError(f"invalid fpv2 selection options ({names}): {exc}") from exc
        kwargs: dict[str, object] = {"selection": selection}
        for name, variable in (("strategy", "FPV2_STRATEGY"), ("backend", "FPV2_BACKEND")):
            raw = env.get(variable)
            if raw is not None and raw.strip():
                kwargs[name] = raw.strip()
        for name, variable in (
            ("correction", "FPV2_CORRECTION"),
            ("validate", "FPV2_VALIDATE"),
            ("chunk_aware", "FPV2_CHUNK_AWARE"),
        ):
            raw = env.get(variable)
            if raw is not None and raw.strip():
                kwargs[name] = _parse_bool(variable, raw)
        raw = env.get("FPV2_CHUNK_STATE_MB")
        if raw is not None and raw.strip():
            try:
                kwargs["chunk_state_mb"] = int(raw.strip())
            except ValueError:
                raise ValueError(f"FPV2_CHUNK_STATE_MB={raw!r} is not a valid int") from None
            if kwargs["chunk_state_mb"] < 0:
                raise ValueError(f"FPV2_CHUNK_STATE_MB={raw!r} must be >= 0")
        return cls(**kwargs)

    def selection_for_scale(self, scale: float) -> SelectionConfig:
        """The selection parameters with the softmax scale of one layer.

        Args:
            scale: the layer's logit scale (``RadixAttention.scaling``).

        Returns:
            A :class:`SelectionConfig` equal to ``selection`` but for its ``softmax_scale``.

        Raises:
            TypeError, ValueError: ``scale`` is not a positive finite number.
        """
        return dataclasses.replace(self.selection, softmax_scale=float(scale))


def _parse_bool(variable: str, raw: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False; anything else is refused."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{variable}={raw!r} is not a boolean; use one of {sorted(_TRUE | _FALSE)}")
