"""Locating and loading ``libfpv2_kernel.so``, and the ABI version handshake.

The library is looked up in two places only:

1. the file named by the environment variable ``FPV2_KERNEL_LIBRARY`` (e.g. a
   development build: ``build/packages/fpv2-kernel/libfpv2_kernel.so``);
2. the copy installed in the wheel, ``fpv2/kernel/lib/libfpv2_kernel.so``.

The library links no libtorch, so one build serves every PyTorch version.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from .errors import NativeLibraryError
from .structs import BlockIndexStruct, CorrectionPlanStruct, PagedBatchStruct, PrefillArgsStruct, ScoreArgsStruct

#: ABI major version this binding speaks; the library's must be equal.
ABI_VERSION_MAJOR = 1
#: ABI minor version this binding needs at least (minor versions only append). 1.2 added the correction
#: plan's E4M3 copies: a 1.1 library would ignore them (and refuse the float32 pooled statistics sent
#: with them) with a misleading message, so it is refused on load instead; likewise 1.5 added the key
#: spread of the second-order mass shift, which an older library would drop (running the mean correction).
ABI_VERSION_MINOR = 5
#: Environment variable naming the library file to load instead of the packaged one.
LIBRARY_ENV = "FPV2_KERNEL_LIBRARY"
#: File name of the library.
LIBRARY_FILENAME = "libfpv2_kernel.so"


def packaged_library_path() -> Path:
    """Where a wheel installs the library: ``fpv2/kernel/lib/libfpv2_kernel.so``.

    Returns:
        The path (which may not exist, e.g. in a source checkout or a CPU-only install).
    """
    return Path(__file__).resolve().parent.parent / "lib" / LIBRARY_FILENAME


def library_path() -> Path:
    """The library file to load: ``$FPV2_KERNEL_LIBRARY`` if set, else the packaged copy.

    Returns:
        An existing file.

    Raises:
        NativeLibraryError: the file does not exist (the message says how to get one).
    """
    return _library_path(os.environ.get(LIBRARY_ENV) or "")


def _library_path(override: str) -> Path:
    """:func:`library_path` for a given value of ``$FPV2_KERNEL_LIBRARY`` ("" when unset)."""
    if override:
        path = Path(override)
        if not path.is_file():
            raise NativeLibraryError(f"{LIBRARY_ENV}={override} does not name an existing file")
        return path
    path = packaged_library_path()
    if not path.is_file():
        raise NativeLibraryError(
            f"{LIBRARY_FILENAME} is not installed at {path}: this fpv2-kernel was built without a CUDA compiler "
            f"(FPV2_BUILD_NATIVE=AUTO found none) or runs from a source tree. Build the library (e.g. "
            f"`cmake -S . -B build && cmake --build build` at the repository root) and set {LIBRARY_ENV} to it, "
            f"or install a wheel built with nvcc"
        )
    return path


def check_abi_version(
    found: tuple[int, int],
    path: str | os.PathLike[str],
    expected: tuple[int, int] = (ABI_VERSION_MAJOR, ABI_VERSION_MINOR),
) -> None:
    """Refuse a library whose ABI this binding cannot speak.

    Args:
        found: ``(major, minor)`` reported by the library.
        path: the library file (named in the message).
        expected: ``(major, minor)`` this binding was written for.

    Raises:
        NativeLibraryError: the majors differ, or the library's minor is older than needed.
    """
    (found_major, found_minor), (want_major, want_minor) = found, expected
    if found_major != want_major:
        raise NativeLibraryError(
            f"{path} implements fpv2 C ABI {found_major}.{found_minor}, but this fpv2.kernel binding speaks ABI "
            f"{want_major}.x (needs {want_major}.{want_minor} or a later {want_major}.x); install matching versions "
            f"of the library and the Python package"
        )
    if found_minor < want_minor:
        raise NativeLibraryError(
            f"{path} implements fpv2 C ABI {found_major}.{found_minor}, older than the ABI {want_major}.{want_minor} "
            f"this fpv2.kernel binding needs; rebuild or upgrade the library"
        )


def _declare(lib: ctypes.CDLL) -> None:
    """Set argtypes/restypes of every ABI function, so ctypes checks and converts arguments."""
    i32, cstr = ctypes.c_int32, ctypes.c_char_p
    signatures: dict[str, tuple[list[object], object]] = {
        "fpv2_get_abi_version": ([ctypes.POINTER(i32), ctypes.POINTER(i32)], None),
        "fpv2_get_build_info": ([], cstr),
        "fpv2_status_string": ([i32], cstr),
        "fpv2_get_last_error": ([], cstr),
        "fpv2_validate_paged_batch": ([ctypes.POINTER(PagedBatchStruct)], i32),
        "fpv2_validate_block_index": ([ctypes.POINTER(BlockIndexStruct), ctypes.POINTER(PagedBatchStruct)], i32),
        "fpv2_validate_correction_plan": (
            [ctypes.POINTER(CorrectionPlanStruct), ctypes.POINTER(PagedBatchStruct)],
            i32,
        ),
        "fpv2_validate_prefill": ([ctypes.POINTER(PrefillArgsStruct)], i32),
        "fpv2_hopper_kernel_available": ([], i32),
        "fpv2_prefill": ([ctypes.POINTER(PrefillArgsStruct)], i32),
        "fpv2_prefill_workspace_size": ([ctypes.POINTER(PrefillArgsStruct), ctypes.POINTER(ctypes.c_uint64)], i32),
        "fpv2_score_blocks": ([ctypes.POINTER(ScoreArgsStruct)], i32),
        "fpv2_validate_score_blocks": ([ctypes.POINTER(ScoreArgsStruct)], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        try:
            function = getattr(lib, name)
        except AttributeError as exc:
            raise NativeLibraryError(
                f"{lib._name} does not export {name}, part of the fpv2 C ABI {ABI_VERSION_MAJOR}.{ABI_VERSION_MINOR} "
                "this binding speaks"
            ) from exc
        function.argtypes = argtypes
        function.restype = restype


def library_abi_version(lib: ctypes.CDLL) -> tuple[int, int]:
    """The ``(major, minor)`` ABI version a loaded library reports.

    Args:
        lib: a loaded library with its functions declared.

    Returns:
        The version pair.
    """
    major, minor = ctypes.c_int32(-1), ctypes.c_int32(-1)
    lib.fpv2_get_abi_version(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as exc:
        raise NativeLibraryError(f"cannot load {path}: {exc}") from exc
    _declare(lib)
    check_abi_version(library_abi_version(lib), path)
    return lib


def load_native_library() -> ctypes.CDLL:
    """Load ``libfpv2_kernel`` once per path, declare its functions and check its ABI version.

    Returns:
        The loaded library (cached: later calls with the same path return the same object).

    Raises:
        NativeLibraryError: not found, not loadable, or built for an incompatible ABI.
    """
    return _load_from_environment(os.environ.get(LIBRARY_ENV) or "")


@functools.cache
def _load_from_environment(override: str) -> ctypes.CDLL:
    # Keyed by $FPV2_KERNEL_LIBRARY: the path is resolved and stat'ed once per value, not on every prefill
    # call (a syscall on the host path the GPU waits for). Failures are not cached, so they are re-checked.
    return _load(str(_library_path(override)))


def native_status() -> tuple[bool, str]:
    """Whether the native library can be used, and why not (or what it is).

    Returns:
        ``(True, "<path>: <build info>")`` or ``(False, <reason>)``.
    """
    try:
        path = library_path()
        lib = _load(str(path))
    except NativeLibraryError as exc:
        return False, str(exc)
    return True, f"{path}: {lib.fpv2_get_build_info().decode()}"


def abi_version() -> tuple[int, int]:
    """ABI ``(major, minor)`` of the loaded library.

    Returns:
        The version pair.

    Raises:
        NativeLibraryError: the library cannot be loaded.
    """
    return library_abi_version(load_native_library())
