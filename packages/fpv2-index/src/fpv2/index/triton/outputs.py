"""Fresh output tensors of one call carved from a single allocation.

The index stage's outputs (pooled statistics, the CSR index) are handed to the
caller, who may keep them across later calls, so they cannot come from a
reused workspace: every call returns new memory. Allocating each output on
its own costs one caching-allocator round trip per tensor (about 4 us of host
time each on CUDA); carving all outputs of a call out of one ``torch.empty``
costs one, plus a view per output. Every part starts on a 512-byte boundary,
the alignment a separate CUDA allocation would have.

The parts share one storage: it is freed when the last of them is dropped.
"""

from __future__ import annotations

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
        One uninitialised contiguous tensor per part, in order, each 512-byte aligned.
    """
    dtypes = {dtype for _, dtype in parts}
    unit = torch.uint8 if len(dtypes) != 1 else next(iter(dtypes))
    unit_bytes = _itemsize(unit)
    align = PART_ALIGN // unit_bytes
    spans = []
    total = 0
    for shape, dtype in parts:
        numel = 1
        for n in shape:
            numel *= n
        size = numel * _itemsize(dtype) // unit_bytes
        spans.append((total, size))
        total += -(-size // align) * align
    buf = torch.empty(max(total, 1), dtype=unit, device=device)
    out = []
    for (shape, dtype), (start, size) in zip(parts, spans):
        t = buf[start : start + size]
        if dtype != unit:
            t = t.view(dtype)
        if len(shape) != 1:
            t = t.view(shape)
        out.append(t)
    return out


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (cached: this runs on every call)."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size
