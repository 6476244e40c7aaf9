"""Small host-to-device copies that never make the host wait for the device.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then
synchronises the stream: the host stops until every kernel queued before it
has run, and the GPU idles while the host prepares the next launches. In a
pipeline that queues pooling, selection and attention back to back (or chunk
after chunk) that stall is paid per copy. :func:`device_ints` stages the values
in pinned memory (PyTorch's caching host allocator, which keeps a block until
the copies reading it have run) and copies them without blocking.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_ints(
    values: Sequence[int] | torch.Tensor, device: torch.device | str, *, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """A 1-D integer tensor of host ``values`` on ``device``, copied without a host synchronisation.

    Args:
        values: the host integers (a sequence, or a CPU tensor).
        device: target device.
        dtype: element type (``torch.int32`` by default).

    Returns:
        The ``(len(values),)`` tensor on ``device``; on CUDA its copy is queued on the
        current stream, so kernels queued after it on that stream see the values.

    Raises:
        TypeError: ``dtype`` is not an integer type.
        ValueError: ``values`` is a tensor that is not on the CPU (reading it would be the sync avoided here).
    """
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"device_ints needs an integer dtype, got {dtype}")
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"values must be host values; got a tensor on {values.device}")
        host = values.detach().to(device="cpu", dtype=dtype).reshape(-1)
    else:
        host = torch.tensor(list(values), dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
