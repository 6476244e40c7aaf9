"""vLLM plugin: registers the fpv2 backend as ``AttentionBackendEnum.CUSTOM`` in every vLLM process.

vLLM runs every function of the ``vllm.general_plugins`` entry point group in
each of its processes (API server, engine core, workers) before it builds a
model. ``fpv2-serving`` declares::

    [project.entry-points."vllm.general_plugins"]
    fpv2 = "fpv2.serving.adapters.vllm_plugin:register"

so installing it next to vLLM is enough; select the backend with
``--attention-backend CUSTOM``. ``VLLM_PLUGINS`` (a comma-separated allow-list
of plugin names) can exclude it.

:func:`register` only records the class path in vLLM's registry (vLLM imports
the class when a model asks for ``CUSTOM``), may run any number of times, and
never replaces a ``CUSTOM`` backend that another plugin registered first.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: Entry point group vLLM loads general plugins from.
ENTRY_POINT_GROUP = "vllm.general_plugins"
#: Entry point name and target of this plugin.
ENTRY_POINT_NAME = "fpv2"
ENTRY_POINT_VALUE = "fpv2.serving.adapters.vllm_plugin:register"
#: Class path registered as ``AttentionBackendEnum.CUSTOM``.
BACKEND_CLASS_PATH = "fpv2.serving.adapters.vllm_backend.Fpv2AttentionBackend"


def register() -> bool:
    """Register :class:`~.vllm_backend.Fpv2AttentionBackend` as vLLM's ``CUSTOM`` attention backend.

    Returns:
        True when ``CUSTOM`` now points at the fpv2 backend; False (with a
        warning naming the other class) when another backend already holds it.

    Raises:
        ImportError: vLLM (its ``vllm.v1.attention.backends.registry``) cannot be imported.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden():
        current = custom.get_path()
        if current == BACKEND_CLASS_PATH:
            return True
        logger.warning(
            "vLLM's CUSTOM attention backend is already registered as %s; the fpv2 backend (%s) is not "
            "registered. Exclude the other plugin with VLLM_PLUGINS to use fpv2.",
            current,
            BACKEND_CLASS_PATH,
        )
        return False
    register_backend(custom, BACKEND_CLASS_PATH)
    logger.info("fpv2: registered %s as vLLM's CUSTOM attention backend", BACKEND_CLASS_PATH)
    return True
