"""FP8 (e4m3) semantics of the kernels: per-group scaling of Q, K, V and the rounding of P.

Scales follow one convention everywhere: a stored FP8 value ``x8`` stands for
``x8 * descale``. Each group's descale is ``amax / 448`` so its largest
magnitude maps onto the largest finite e4m3 value. A group whose values are all
zero gets descale 1 (nothing to scale; no division by zero).

Non-finite inputs are not sanitised, they propagate: a NaN or an infinity
anywhere in a scaling group makes that group's amax, hence its descale,
non-finite, and every dequantised value of the group becomes NaN. Other groups
are unaffected. Finite values are clamped to +-448 before the cast, so the
result never depends on how a given device converts out-of-range floats.
"""

from __future__ import annotations

import torch

from ..contracts import PagedPrefillBatch
from ..contracts._checks import check_tensor, describe

#: Largest finite ``float8_e4m3fn`` magnitude.
FP8_E4M3_MAX = 448.0
#: Probabilities relative to the row maximum are multiplied by ``2**8`` before the
#: FP8 cast: [0, 1] becomes [0, 256], which keeps small probabilities out of the
#: e4m3 subnormal range (the smallest normal is 2**-6). The factor cancels in the
#: softmax normalisation.
PROBABILITY_SHIFT = 2.0**8

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def descale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` in float32, with 1 where amax is 0 (NaN stays NaN, inf stays inf).

    The divisor is a tensor: torch divides a CUDA tensor by a Python scalar as a multiplication
    by its reciprocal, which differs from the IEEE quotient (what the kernels compute) in the last
    bit for about half of the values.

    Args:
        amax: absolute maxima, any shape.

    Returns:
        The descales, float32, same shape.
    """
    amax = amax.float()
    return torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_E4M3_MAX))


def saturate_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Cast scaled values to e4m3 with saturation to +-448 (clamp keeps NaN), rounding to nearest even.

    Args:
        x: values already divided by their descale.

    Returns:
        ``float8_e4m3fn`` values, same shape.
    """
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _row_group_descale(descale: torch.Tensor, batch: PagedPrefillBatch, group: int) -> torch.Tensor:
    """Expand a ``(B, Hkv)`` query descale to ``(total_q, Hq, 1)``: one factor per packed query and head."""
    q_lens = torch.tensor(batch.host.q_lens, device=descale.device)
    per_token = torch.repeat_interleave(descale, q_lens, dim=0, output_size=batch.total_q)  # (total_q, Hkv)
    return per_token.repeat_interleave(group, dim=1)[:, :, None]


def quantize_queries(q: torch.Tensor, batch: PagedPrefillBatch, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise packed queries with one scale per (request, KV head group).

    Args:
        q: ``(total_q, Hq, d)`` float queries.
        batch: the batch the queries belong to.
        num_kv_heads: ``Hkv``; query heads ``h*g .. h*g+g-1`` share the scale of KV head ``h``.

    Returns:
        ``q_fp8 (total_q, Hq, d) float8_e4m3fn`` and ``q_descale (B, Hkv) float32``.
        Zero-length requests get descale 1.

    Raises:
        TypeError: ``q`` is not a floating tensor.
        ValueError: shapes inconsistent with ``batch`` or ``num_kv_heads``.
    """
    check_tensor("q", q, dtypes=_FLOAT_DTYPES, ndim=3)
    if q.shape[0] != batch.total_q:
        raise ValueError(f"q must hold cu_seqlens_q[-1]={batch.total_q} queries; got {describe(q)}")
    if num_kv_heads <= 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"q has Hq={q.shape[1]} heads ({describe(q)}), not a multiple of num_kv_heads={num_kv_heads}")
    group = q.shape[1] // num_kv_heads
    cu = batch.host.cu_seqlens_q
    amax = torch.zeros(batch.num_requests, num_kv_heads, dtype=torch.float32, device=q.device)
    for b in range(batch.num_requests):
        q_b = q[cu[b] : cu[b + 1]].float()
        if q_b.shape[0]:
            # (q_len, Hkv, g * d): the amax of each KV head group over the request's positions.
            amax[b] = q_b.reshape(q_b.shape[0], num_kv_heads, group * q.shape[2]).abs().amax(dim=(0, 2))
    descale = descale_from_amax(amax)
    q_fp8 = saturate_to_e4m3(q.float() / _row_group_descale(descale, batch, group))
    return q_fp8, descale


def dequantize_queries(
    q_fp8: torch.Tensor, q_descale: torch.Tensor, batch: PagedPrefillBatch, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Real-valued queries ``q_fp8 * q_descale`` (inverse of :func:`quantize_queries` up to rounding).

    Args:
        q_fp8: ``(total_q, Hq, d) float8_e4m3fn``.
        q_descale: ``(B, Hkv) float32``.
        batch: the batch the queries belong to.
        dtype: output dtype.

    Returns:
        ``(total_q, Hq, d)`` tensor of ``dtype``.

    Raises:
        TypeError, ValueError: wrong dtypes or shapes.
    """
    check_tensor("q_fp8", q_fp8, dtypes=(torch.float8_e4m3fn,), ndim=3)
    check_tensor("q_descale", q_descale, dtypes=(torch.float32,), ndim=2, device=q_fp8.device)
    if q_descale.shape[0] != batch.num_requests or q_fp8.shape[1] % q_descale.shape[1]:
        raise ValueError(
            f"q_descale must have shape ({batch.num_requests}, Hkv) with Hkv dividing Hq={q_fp8.shape[1]}; "
            f"got {describe(q_descale)}"
        )
    group = q_fp8.shape[1] // q_descale.shape[1]
    return (q_fp8.float() * _row_group_descale(q_descale, batch, group)).to(dtype)


def quantize_cache(cache: torch.Tensor, batch: PagedPrefillBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a paged K or V cache with one scale per KV head over the whole cache.

    Pages may be shared between requests (a cached prefix, beam or parallel
    sampling), so a page cannot be stored with a per-request scale: the scale is
    taken over every page of the cache and repeated for each request. The kernel
    contract still takes ``(B, Hkv)`` descales, so engines that own per-request
    pages may use finer scales.

    Args:
        cache: ``(num_pages, page_size, Hkv, d)`` float cache.
        batch: the batch (its request count sets the descale rows).

    Returns:
        ``cache_fp8`` of the same shape in ``float8_e4m3fn`` and ``descale (B, Hkv) float32``
        (identical rows).

    Raises:
        TypeError: ``cache`` is not a floating tensor.
    """
    check_tensor("cache", cache, dtypes=_FLOAT_DTYPES, ndim=4)
    amax = cache.float().abs().amax(dim=(0, 1, 3)) if cache.numel() else cache.new_zeros(cache.shape[2])
    per_head = descale_from_amax(amax)  # (Hkv,)
    cache_fp8 = saturate_to_e4m3(cache.float() / per_head[None, None, :, None])
    return cache_fp8, per_head[None, :].repeat(batch.num_requests, 1).contiguous()


def dequantize_cache(
    cache_fp8: torch.Tensor, descale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Real-valued cache ``cache_fp8 * descale`` for a per-KV-head scale.

    A whole cache can only be dequantised page by page when every request uses
    the same scale for a head (pages may be shared); per-request scales must be
    applied after gathering a request's tokens, as the attention references do.

    Args:
        cache_fp8: ``(num_pages, page_size, Hkv, d) float8_e4m3fn``.
        descale: ``(B, Hkv)`` with identical rows (as :func:`quantize_cache` returns) or ``(Hkv,)``.
        dtype: output dtype.

    Returns:
        ``(num_pages, page_size, Hkv, d)`` tensor of ``dtype``.

    Raises:
        TypeError: wrong dtypes.
        ValueError: wrong shapes, or rows of ``descale`` that differ (host sync).
    """
    check_tensor("cache_fp8", cache_fp8, dtypes=(torch.float8_e4m3fn,), ndim=4)
    check_tensor("descale", descale, dtypes=(torch.float32,), device=cache_fp8.device)
    hkv = cache_fp8.shape[2]
    if descale.dim() == 2 and descale.shape[1] == hkv and descale.shape[0] >= 1:
        if not torch.equal(descale, descale[:1].expand_as(descale)):
            raise ValueError(
                f"descale rows differ between requests ({describe(descale)}); a shared paged cache has one scale per "
                "KV head: dequantise per request after gathering its tokens instead"
            )
        descale = descale[0]
    if descale.shape != (hkv,):
        raise ValueError(f"descale must have shape (B, {hkv}) or ({hkv},); got {describe(descale)}")
    return (cache_fp8.float() * descale[None, None, :, None]).to(dtype)


def quantize_probabilities(p: torch.Tensor) -> torch.Tensor:
    """The kernel's rounding of softmax probabilities before the FP8 PV GEMM.

    ``p`` holds probabilities relative to the row maximum, ``exp(s - m)`` in
    [0, 1]. They are scaled onto [0, 256] (``x 2**8``), rounded to e4m3 and scaled
    back, so the result lies on the e4m3 grid divided by 256. Values above
    ``448 / 256 = 1.75`` saturate, NaN stays NaN.

    Args:
        p: floating tensor of relative probabilities, any shape.

    Returns:
        The rounded probabilities, same shape and dtype as ``p``.

    Raises:
        TypeError: ``p`` is not a floating tensor.
    """
    check_tensor("p", p, dtypes=_FLOAT_DTYPES)
    return (saturate_to_e4m3(p.float() * PROBABILITY_SHIFT).float() / PROBABILITY_SHIFT).to(p.dtype)
