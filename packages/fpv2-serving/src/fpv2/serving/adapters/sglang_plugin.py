"""Registration of the fpv2 backend with SGLang, from outside SGLang.

Two public hooks of SGLang 0.5.23 are used, nothing else of it is touched:

- ``sglang.srt.layers.attention.attention_registry.register_attention_backend``
  adds a factory to ``ATTENTION_BACKENDS``, the dict SGLang builds every
  attention backend from (prefill and decode alike);
- ``sglang.srt.arg_groups.choices.add_attention_backend_choices`` adds the name
  to the choices of ``--attention-backend``, ``--prefill-attention-backend`` and
  ``--decode-attention-backend``.

SGLang runs every installed ``sglang.srt.plugins`` entry point through
``sglang.srt.plugins.load_plugins()`` in the launcher before the command line
is parsed and again in each scheduler process, so with this in
``fpv2-serving``'s ``pyproject.toml``::

    [project.entry-points."sglang.srt.plugins"]
    fpv2 = "fpv2.serving.adapters.sglang_plugin:register"

``sglang serve --prefill-attention-backend fpv2 --decode-attention-backend fa3``
works on an unmodified SGLang (``SGLANG_PLUGINS`` may restrict which plugins load).
Without the entry point, call :func:`register_sglang_backend` before SGLang
parses its arguments (e.g. in a launcher script).
"""

from __future__ import annotations

from collections.abc import Callable

from .sglang_options import SGLangBackendOptions

#: The name under which the backend is registered by default.
BACKEND_NAME = "fpv2"

# Marks factories made here, so re-registering one of ours is allowed and shadowing SGLang's is not.
_FACTORY_MARK = "__fpv2_sglang_factory__"


def make_backend_factory(options: SGLangBackendOptions | None = None) -> Callable[[object], object]:
    """A registry factory: ``factory(model_runner)`` builds a :class:`Fpv2AttnBackend`.

    Args:
        options: options for every backend the factory builds (None: each reads
            ``FPV2_*`` environment variables of its own process).

    Returns:
        The factory.

    Raises:
        TypeError: ``options`` is not a :class:`SGLangBackendOptions` or None.
    """
    if options is not None and not isinstance(options, SGLangBackendOptions):
        raise TypeError(f"options must be a SGLangBackendOptions or None; got {type(options).__name__}")

    def create_fpv2_backend(model_runner: object) -> object:
        # Imported here: registering stays cheap, and the pipeline loads only when a backend is built.
        from .sglang_backend import Fpv2AttnBackend

        return Fpv2AttnBackend(model_runner, options=options)

    setattr(create_fpv2_backend, _FACTORY_MARK, True)
    return create_fpv2_backend


def register_sglang_backend(name: str = BACKEND_NAME, *, options: SGLangBackendOptions | None = None) -> None:
    """Add the fpv2 backend to SGLang's attention backend registry and command-line choices.

    Idempotent: registering again replaces fpv2's own factory (e.g. with new
    options) and adds the name to the choices once.

    Args:
        name: the backend name for ``--prefill-attention-backend``.
        options: see :func:`make_backend_factory`.

    Raises:
        TypeError: ``name`` is not a str or ``options`` has the wrong type.
        ValueError: ``name`` is empty or names a backend SGLang already has.
        ImportError: SGLang is not installed.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {type(name).__name__}")
    if not name.strip() or name != name.strip():
        raise ValueError(f"name must be a non-empty backend name without surrounding spaces; got {name!r}")
    factory = make_backend_factory(options)
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    existing = ATTENTION_BACKENDS.get(name)
    ours = existing is not None and getattr(existing, _FACTORY_MARK, False)
    if not ours and (existing is not None or name in ATTENTION_BACKEND_CHOICES):
        raise ValueError(f"SGLang already has an attention backend named {name!r}; register fpv2 under another name")
    register_attention_backend(name)(factory)
    if name not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([name])


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: register ``"fpv2"`` with options from the environment."""
    register_sglang_backend()
