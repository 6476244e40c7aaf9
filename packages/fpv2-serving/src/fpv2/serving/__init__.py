"""fpv2.serving: the sparse prefill pipeline, attention backends and the ``fpv2`` command line.

The pipeline and backend names are exported lazily, so ``fpv2 info`` still
starts (and reports the problem) when a sibling wheel cannot be imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fpv2.kernel._compat import check_siblings as _check_siblings

from ._version import __version__

_check_siblings("fpv2-serving")

if TYPE_CHECKING:
    from .backends import available_backends
    from .chunked import ChunkedPrefillPipeline, ChunkedPrefillResult, ChunkResult
    from .chunked_state import ChunkedPrefillState
    from .pipeline import PrefillResult, SparsePrefillPipeline
    from .routing import DensityRouter, RoutedPrefillPipeline, RoutingTable
    from .soak import SoakConfig, run_soak
    from .timing import StageTimings

_LAZY = {
    "SparsePrefillPipeline": "pipeline",
    "PrefillResult": "pipeline",
    "StageTimings": "timing",
    "available_backends": "backends",
    "ChunkedPrefillPipeline": "chunked",
    "ChunkedPrefillResult": "chunked",
    "ChunkResult": "chunked",
    "ChunkedPrefillState": "chunked_state",
    "DensityRouter": "routing",
    "RoutedPrefillPipeline": "routing",
    "RoutingTable": "routing",
    "SoakConfig": "soak",
    "run_soak": "soak",
}

__all__ = [
    "ChunkResult",
    "ChunkedPrefillPipeline",
    "ChunkedPrefillResult",
    "ChunkedPrefillState",
    "DensityRouter",
    "PrefillResult",
    "RoutedPrefillPipeline",
    "RoutingTable",
    "SoakConfig",
    "SparsePrefillPipeline",
    "StageTimings",
    "__version__",
    "available_backends",
    "run_soak",
]


def __getattr__(name: str) -> object:
    """Import the exported names on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
