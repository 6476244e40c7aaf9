"""Validation of the tensors of one prefill call against its batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_last_dim_contiguous, check_shape, check_tensor, describe
from .paged_batch import PagedPrefillBatch

#: Element types accepted for Q, K and V. fp32 is for references and tests.
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
#: Head dimensions the kernels are built for.
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class PrefillShapes:
    """Sizes shared by every stage of one prefill call."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def group(self) -> int:
        """GQA group size ``g = Hq / Hkv``: query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def is_fp8(self) -> bool:
        """Whether Q/K/V are float8_e4m3fn (descales required)."""
        return self.dtype == torch.float8_e4m3fn


def validate_prefill_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> PrefillShapes:
    """Check Q and the paged K/V cache against ``batch``; return the shared sizes.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache, v_cache: ``(num_pages, page_size, Hkv, d)`` paged cache.
        batch: the batch metadata (already validated on construction).
        q_descale, k_descale, v_descale: ``(B, Hkv) float32`` dequantisation
            factors, required when Q/K/V are ``float8_e4m3fn`` and refused otherwise.

    Raises:
        TypeError, ValueError: naming the argument, its shape and dtype.
    """
    device = batch.device
    q = check_tensor("q", q, dtypes=ACTIVATION_DTYPES, ndim=3, device=device)
    k_cache = check_tensor("k_cache", k_cache, dtypes=ACTIVATION_DTYPES, ndim=4, device=device)
    v_cache = check_tensor("v_cache", v_cache, dtypes=ACTIVATION_DTYPES, ndim=4, device=device)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share one dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    _, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, head_dim_k = k_cache.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS}; q has {describe(q)}")
    check_shape("k_cache", k_cache, (batch.num_pages, batch.page_size, None, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    del num_pages, page_size, head_dim_k
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"Hq % Hkv != 0: q has Hq={num_q_heads} heads ({describe(q)}) and k_cache has Hkv={num_kv_heads} "
            f"({describe(k_cache)}); grouped-query attention needs Hq to be a multiple of Hkv"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if q.shape[0] != batch.total_q:
        raise ValueError(f"q must hold cu_seqlens_q[-1]={batch.total_q} packed queries; got {describe(q)}")
    for name, scale in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        check_descale(name, scale, q.dtype, batch, num_kv_heads)
    return PrefillShapes(num_q_heads, num_kv_heads, head_dim, q.dtype)


def check_descale(
    name: str, scale: torch.Tensor | None, dtype: torch.dtype, batch: PagedPrefillBatch, num_kv_heads: int
) -> None:
    """An FP8 descale: ``(B, Hkv) float32`` on the batch's device for e4m3 inputs, None for any other dtype.

    Args:
        name: the argument's name, for the message.
        scale: the descale, or None.
        dtype: the element type of the inputs it scales.
        batch: the batch (its request count and device).
        num_kv_heads: ``Hkv``.

    Raises:
        TypeError, ValueError: a missing, superfluous or misshapen descale, named.
    """
    is_fp8 = dtype == torch.float8_e4m3fn
    if is_fp8 and scale is None:
        raise ValueError(f"{name} is required for float8_e4m3fn inputs (shape ({batch.num_requests}, {num_kv_heads}))")
    if not is_fp8 and scale is not None:
        raise ValueError(f"{name} is only meaningful for float8_e4m3fn inputs; the inputs have dtype {dtype}")
    if scale is not None:
        check_tensor(name, scale, dtypes=(torch.float32,), ndim=2, device=batch.device)
        check_shape(name, scale, (batch.num_requests, num_kv_heads))
