"""Fresh output tensors of one call carved from a single allocation.

The index stage's outputs (pooled statistics, the CSR index) are handed to the
caller, who may keep them across later calls, so they cannot come from a
reused workspace: every call returns new memory. Allocating each output on
its own costs one caching-allocator round trip per tensor (about 4 us of host
time each on CUDA); carving all outputs of a call out of one ``torch.empty``
costs one, plus a view per output. Every part starts on a 512-byte boundary,
the alignment a separate CUDA allocation would have.

The parts share one storage: it is freed when the last of them is dropped.

Under :func:`torch.inference_mode` (engines such as vLLM run their forward pass
in it) the parts are still made as normal tensors: inference tensors keep no
version counter, and the copies cached beside the pooled statistics
(:mod:`.prepared_keys`) check their source's version before they are reused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

#: Byte alignment of every part (the CUDA caching allocator's block alignment).
PART_ALIGN = 512


def fresh_outputs(device: torch.device, parts: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """New contiguous tensors of the given shapes and dtypes, from one allocation on ``device``.

    Args:
        device: where to allocate.
        parts: ``(shape, dtype)`` of each output.

    Returns:
        One uninitialised contiguous tensor per part, in order, each 512-byte aligned (normal tensors,
        with version counters, also under :func:`torch.inference_mode`).
    """
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return _carve(device, parts)
    return _carve(device, parts)


def _carve(device: torch.device, parts: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    unit, total, layout = _layout(tuple((tuple(shape), dtype) for shape, dtype in parts))
    buf = torch.empty(total, dtype=unit, device=device)
    # One view per dtype, then one as_strided view per part: a slice plus two views per part cost
    # three torch calls each (~1-1.5 us of host time apiece).
    typed = {unit: buf}
    out = []
    for shape, strides, dtype, offset in layout:
        view = typed.get(dtype)
        if view is None:
            view = typed[dtype] = buf.view(dtype)
        out.append(view.as_strided(shape, strides, offset))
    return out


@functools.lru_cache(maxsize=256)
def _layout(
    parts: tuple[tuple[tuple[int, ...], torch.dtype], ...],
) -> tuple[torch.dtype, int, tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, int], ...]]:
    """The buffer's unit dtype, its length in units and each part's (shape, strides, dtype, offset).

    Memoised: the same parts come back on every layer of a forward pass (making the pooling's seven outputs
    was about half of its launch's host time in the pipeline, 2026-12-04).
    """
    dtypes = {dtype for _, dtype in parts}
    unit = torch.uint8 if len(dtypes) != 1 else next(iter(dtypes))
    unit_bytes = unit.itemsize
    align = PART_ALIGN // unit_bytes
    layout = []
    total = 0  # in units
    for shape, dtype in parts:
        itemsize = dtype.itemsize
        if len(shape) == 1:
            numel = shape[0]
            strides: tuple[int, ...] = (1,)
        else:  # contiguous strides as torch gives them (an empty dimension counts as 1)
            reversed_strides = []
            numel = stride = 1
            for n in reversed(shape):
                reversed_strides.append(stride)
                stride *= n or 1
                numel *= n
            strides = tuple(reversed(reversed_strides))
        # The part's offset in its own elements: parts start on 512-byte boundaries, a multiple of any itemsize.
        layout.append((shape, strides, dtype, total * unit_bytes // itemsize))
        total += -(-(numel * itemsize // unit_bytes) // align) * align
    # At least one aligned span, so that the buffer can be viewed in every part's dtype.
    return unit, total or align, tuple(layout)
