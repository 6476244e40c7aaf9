"""Options of the vLLM adapter, read from ``FPV2_VLLM_*`` environment variables.

vLLM builds attention backends, impls and metadata builders itself, in every
worker process, with arguments it chooses; a plugin cannot hand them extra
parameters. The adapter therefore reads its options from the environment,
which vLLM's worker processes inherit. Every option has a default, so an
unset environment gives the documented behaviour:

=================================  ==========================  ============================================
variable                           default                     meaning
=================================  ==========================  ============================================
``FPV2_VLLM_STRATEGY``             ``max_threshold``           selection strategy (``dense`` keeps every
                                                               visible block)
``FPV2_VLLM_CORRECTION``           ``1``                       mean correction for pruned blocks (0 / 1)
``FPV2_VLLM_BACKEND``              ``auto``                    fpv2 attention backend (``hopper``,
                                                               ``triton``, ``reference``, ``auto``)
``FPV2_VLLM_DECODE_BACKEND``       ``auto``                    vLLM backend for decode rows, a name of
                                                               ``AttentionBackendEnum`` (``auto``:
                                                               ``FLASH_ATTN`` on CUDA, else ``TRITON_ATTN``)
``FPV2_VLLM_CHECK_VALUES``         ``0``                       validate page ids of every batch (host sync)
``FPV2_VLLM_<FIELD>``              SelectionConfig default     any field of :class:`fpv2.index.SelectionConfig`
                                                               but ``softmax_scale`` (the model's scale is
                                                               used), e.g. ``FPV2_VLLM_ALPHA=0.12``,
                                                               ``FPV2_VLLM_MIN_SPARSE_KV_LEN=8192``
=================================  ==========================  ============================================

An unknown ``FPV2_VLLM_*`` name is refused (a typo must not silently fall back
to a default). This module does not import vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from fpv2.index import SelectionConfig, available_strategies

#: Prefix of every environment variable the adapter reads.
ENV_PREFIX = "FPV2_VLLM_"
#: Decode backend name that picks vLLM's usual dense backend for the platform.
AUTO_DECODE_BACKEND = "auto"
# SelectionConfig fields settable from the environment (the logit scale comes from the model).
_SELECTION_FIELDS = {f.name: f for f in dataclasses.fields(SelectionConfig) if f.name != "softmax_scale"}
_PLAIN_OPTIONS = ("STRATEGY", "CORRECTION", "BACKEND", "DECODE_BACKEND", "CHECK_VALUES")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(name: str, text: str) -> bool:
    """Parse a 0/1/true/false style flag."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {_TRUE + _FALSE}; got {text!r}")


def _parse_selection_field(name: str, field_name: str, text: str) -> int | float:
    """Parse one SelectionConfig field from its environment text (int fields stay ints)."""
    default = _SELECTION_FIELDS[field_name].default
    try:
        return int(text) if isinstance(default, int) else float(text)
    except ValueError:
        kind = "an int" if isinstance(default, int) else "a float"
        raise ValueError(f"{name} must be {kind}; got {text!r}") from None


@dataclass(frozen=True)
class VllmAdapterOptions:
    """What the vLLM adapter runs; defaults equal an unset environment.

    Attributes:
        config: selection parameters; its ``softmax_scale`` is replaced by the
            layer's scale when an impl is built.
        strategy: selection strategy name (:func:`fpv2.index.available_strategies`).
        correction: add the mean correction for pruned blocks.
        backend: fpv2 attention backend name (see :mod:`fpv2.serving.backends`).
        decode_backend: ``AttentionBackendEnum`` member name of the vLLM backend
            that runs decode rows, or ``"auto"``.
        check_values: validate the page ids of every prefill batch (a host sync).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: unknown strategy or empty backend names.
    """

    config: SelectionConfig = field(default_factory=SelectionConfig)
    strategy: str = "max_threshold"
    correction: bool = True
    backend: str = "auto"
    decode_backend: str = AUTO_DECODE_BACKEND
    check_values: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.config, SelectionConfig):
            raise TypeError(f"config must be a fpv2.index.SelectionConfig; got {type(self.config).__name__}")
        strategies = list(available_strategies())
        if self.strategy not in strategies:
            raise ValueError(f"unknown selection strategy {self.strategy!r}; choose one of: {', '.join(strategies)}")
        for name in ("correction", "check_values"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {type(getattr(self, name)).__name__}")
        for name in ("backend", "decode_backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string; got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VllmAdapterOptions:
        """Read the options from ``FPV2_VLLM_*`` variables (see the module docstring).

        Args:
            environ: the environment to read (None: ``os.environ``).

        Returns:
            The options.

        Raises:
            ValueError: an unknown ``FPV2_VLLM_*`` name or an unparsable value
                (the message names the variable).
        """
        env = os.environ if environ is None else environ
        known = set(_PLAIN_OPTIONS) | {name.upper() for name in _SELECTION_FIELDS}
        given = {key[len(ENV_PREFIX) :]: value for key, value in env.items() if key.startswith(ENV_PREFIX)}
        unknown = sorted(set(given) - known)
        if unknown:
            names = ", ".join(ENV_PREFIX + name for name in unknown)
            valid = ", ".join(ENV_PREFIX + name for name in sorted(known))
            raise ValueError(f"unknown fpv2 vLLM option(s) {names}; valid names: {valid}")
        selection = {
            name: _parse_selection_field(ENV_PREFIX + name.upper(), name, given[name.upper()])
            for name in _SELECTION_FIELDS
            if name.upper() in given
        }
        kwargs: dict[str, object] = {"config": SelectionConfig(**selection)}
        if "STRATEGY" in given:
            kwargs["strategy"] = given["STRATEGY"].strip()
        if "BACKEND" in given:
            kwargs["backend"] = given["BACKEND"].strip()
        if "DECODE_BACKEND" in given:
            kwargs["decode_backend"] = given["DECODE_BACKEND"].strip()
        for flag, attr in (("CORRECTION", "correction"), ("CHECK_VALUES", "check_values")):
            if flag in given:
                kwargs[attr] = _parse_bool(ENV_PREFIX + flag, given[flag])
        return cls(**kwargs)


@functools.cache
def load_options() -> VllmAdapterOptions:
    """The options of this process, read once from the environment.

    Returns:
        :meth:`VllmAdapterOptions.from_env` of ``os.environ`` at the first call.
    """
    return VllmAdapterOptions.from_env()
