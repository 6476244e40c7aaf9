"""Exceptions raised by the native (C ABI) binding of fpv2.kernel."""

from __future__ import annotations


class NativeLibraryError(RuntimeError):
    """``libfpv2_kernel`` cannot be used: not found, not loadable, or built for another ABI version."""


class NativeError(RuntimeError):
    """The library reported a failure other than a bad argument (CUDA, workspace, internal).

    Attributes:
        status: the ``fpv2_status_t`` code returned by the library.
    """

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class UnsupportedConfigurationError(ValueError):
    """Well-formed arguments describing a configuration the library does not handle (e.g. head dim 96)."""


class HopperKernelNotBuiltError(RuntimeError):
    """The Hopper attention kernel is not part of the loaded library; use another backend."""
