"""A fix for running the kernel under the Triton interpreter with NumPy >= 2.4.

The Triton 3.6 interpreter stores every scalar as a one-element 1-D NumPy array
and converts it for ``range`` (runtime loop bounds) with ``int(array)``. NumPy
2.4 turned that conversion of a 1-D array into a ``TypeError`` ("only
0-dimensional arrays can be converted to Python scalars"), so any kernel whose
loop bounds are computed at run time fails under the interpreter. The fix
converts through ``array.item()`` instead. It is installed only when the kernel
actually runs interpreted, only when this NumPy shows the problem, and only
once; GPU compilation is not touched.
"""

from __future__ import annotations

import numpy as np


def _numpy_refuses_1d_int() -> bool:
    """Whether ``int()`` of a one-element 1-D array raises on this NumPy."""
    try:
        int(np.ones(1, dtype=np.int32))
    except TypeError:
        return True
    return False


def install_interpreter_index_fix() -> bool:
    """Make the interpreter's scalar tensors usable as ``range`` bounds again (idempotent).

    Returns:
        True when the fix is in place (installed now or before), False when it is
        not needed or this Triton has no hook for it (then nothing is changed).
    """
    if not _numpy_refuses_1d_int():
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton without the interpreter
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "_fpv2_index_fix", False):
        return True

    def patch_lang_tensor(tensor: type, scope: object) -> None:
        original(tensor, scope)
        # Same hook the interpreter uses, converting through .item() (size-1 arrays only).
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor._fpv2_index_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
