"""vLLM's own dense backend as the decode path of the fpv2 backend.

Decode rows (and the KV write) are not fpv2's business: they go to one of
vLLM's dense attention backends, named by ``FPV2_VLLM_DECODE_BACKEND`` (see
:mod:`.vllm_options`). ``auto`` picks ``FLASH_ATTN`` on CUDA (vLLM's usual
choice on Hopper) and ``TRITON_ATTN`` elsewhere. The delegate must keep vLLM's
standard cache (logical ``(num_blocks, Hkv, block_size, 2 * head_size)``) and
write the cache outside ``forward`` (``forward_includes_kv_cache_update =
False``), as both of those do in vLLM 0.33.

Imports vLLM (``vllm.v1.attention``).
"""

from __future__ import annotations

import functools

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from .vllm_options import AUTO_DECODE_BACKEND, load_options

#: Dense backends whose kernels need a GPU (CUDA, ROCm or XPU); none runs on CPU tensors.
GPU_ONLY_DECODE_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "ROCM_ATTN", "ROCM_AITER_FA")


def decode_backend_name(name: str) -> str:
    """The ``AttentionBackendEnum`` member name ``name`` stands for (``auto`` resolved).

    Args:
        name: a member name or ``"auto"``.

    Returns:
        ``FLASH_ATTN`` (CUDA) or ``TRITON_ATTN`` (elsewhere) for ``auto``; ``name`` otherwise.
    """
    if name == AUTO_DECODE_BACKEND:
        return "FLASH_ATTN" if current_platform.is_cuda() else "TRITON_ATTN"
    return name


@functools.cache
def resolve_decode_backend(name: str) -> type[AttentionBackend]:
    """The vLLM backend class that runs decode rows.

    Args:
        name: an ``AttentionBackendEnum`` member name or ``"auto"``.

    Returns:
        The backend class.

    Raises:
        ValueError: unknown name (vLLM's message lists the valid ones), ``CUSTOM``
            (the fpv2 backend itself), an MLA backend, or a backend that writes
            the cache inside ``forward``.
    """
    resolved = decode_backend_name(name)
    member = AttentionBackendEnum[resolved]  # raises ValueError naming the valid members
    if member is AttentionBackendEnum.CUSTOM:
        raise ValueError("FPV2_VLLM_DECODE_BACKEND cannot be CUSTOM: that is the fpv2 backend itself")
    backend = member.get_class()
    if backend.is_mla():
        raise ValueError(f"decode backend {resolved} is an MLA backend; fpv2 serves standard (GQA/MHA) attention")
    if backend.forward_includes_kv_cache_update:
        raise ValueError(
            f"decode backend {resolved} writes the KV cache inside forward(); the fpv2 backend needs one that "
            "writes it in do_kv_cache_update() (e.g. FLASH_ATTN, TRITON_ATTN)"
        )
    return backend


def default_decode_backend() -> type[AttentionBackend]:
    """The decode backend of this process's options (:func:`.vllm_options.load_options`).

    Returns:
        The backend class.
    """
    return resolve_decode_backend(load_options().decode_backend)


def check_decode_device(backend_name: str, device: torch.device) -> None:
    """Refuse, with the reason, to run a GPU-only dense backend on CPU tensors.

    Args:
        backend_name: the resolved decode backend name.
        device: device of the decode rows.

    Raises:
        RuntimeError: ``device`` is the CPU and the backend's kernels need a GPU.
    """
    if device.type == "cpu" and backend_name in GPU_ONLY_DECODE_BACKENDS:
        raise RuntimeError(
            f"the batch has decode rows, which the fpv2 backend hands to vLLM's {backend_name} backend, whose "
            "kernels need a GPU; on CPU tensors only prefill-only batches can run"
        )
