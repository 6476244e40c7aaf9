"""Dense causal attention over a paged varlen batch: the readable definition every kernel is tested against.

The reference works one (request, KV head) at a time on PackGQA rows, exactly
as the kernels do, so the sparse reference can reuse the same pieces:

* :func:`request_operands` reads a request's Q, K and V out of the packed
  query tensor and the paged cache, in the compute dtype and in real units
  (FP8 inputs multiplied by their descales);
* :func:`masked_softmax` is one exact softmax over a set of logit columns,
  some of them masked with ``-inf``;
* :func:`dense_attention` walks requests, KV heads and chunks of query
  positions and writes the rows back in ``(total_q, Hq, d)`` layout.
"""

from __future__ import annotations

import math

import torch

from ..contracts import PagedPrefillBatch, PrefillShapes, validate_prefill_inputs
from .packgqa import pack_queries, unpack_rows
from .paged import gather_kv

#: Compute dtypes of the reference: fp32 for everyday tests, fp64 as the oracle.
COMPUTE_DTYPES = (torch.float32, torch.float64)
#: Packed query rows processed at once by the dense reference. Bounds the logit
#: matrix to ``QUERY_CHUNK_ROWS x kv_len`` so a 32K-token request fits a GPU.
QUERY_CHUNK_ROWS = 1024


def check_compute_dtype(compute_dtype: object) -> torch.dtype:
    """Check that ``compute_dtype`` is float32 or float64.

    Args:
        compute_dtype: the requested accumulation dtype.

    Returns:
        The dtype, unchanged.

    Raises:
        TypeError: any other value.
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise TypeError(f"compute_dtype must be torch.float32 or torch.float64; got {compute_dtype!r}")
    return compute_dtype  # type: ignore[return-value]


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax scale: ``1 / sqrt(d)`` unless given.

    Args:
        softmax_scale: explicit scale, or None for the default.
        head_dim: ``d``.

    Returns:
        The scale as a Python float.

    Raises:
        TypeError: ``softmax_scale`` is not a real number.
        ValueError: ``softmax_scale`` is not finite and positive.
    """
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None; got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and positive; got {softmax_scale}")
    return float(softmax_scale)


def request_operands(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    request: int,
    shapes: PrefillShapes,
    compute_dtype: torch.dtype,
    descales: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] = (None, None, None),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One request's queries, keys and values in ``compute_dtype`` and real units.

    Args:
        q: ``(total_q, Hq, d)`` packed queries of the batch.
        k_cache, v_cache: ``(num_pages, page_size, Hkv, d)`` paged cache.
        batch: the batch metadata.
        request: request index ``b``.
        shapes: sizes returned by :func:`validate_prefill_inputs`.
        compute_dtype: float32 or float64.
        descales: ``(q_descale, k_descale, v_descale)``, each ``(B, Hkv)`` or None.
            Query head ``hq`` uses the descale of its KV head ``hq // g``.

    Returns:
        ``q_b (q_len, Hq, d)``, ``k_b (kv_len, Hkv, d)``, ``v_b (kv_len, Hkv, d)``.
    """
    start, end = batch.host.cu_seqlens_q[request], batch.host.cu_seqlens_q[request + 1]
    q_b = q[start:end].to(compute_dtype)
    k_b = gather_kv(k_cache, batch, request).to(compute_dtype)
    v_b = gather_kv(v_cache, batch, request).to(compute_dtype)
    q_descale, k_descale, v_descale = descales
    # FP8 values are stored divided by their scale: multiply back before any arithmetic,
    # so the reference is exact math on the values the kernel actually sees.
    if q_descale is not None:
        q_b = q_b * q_descale[request].to(compute_dtype).repeat_interleave(shapes.group)[None, :, None]
    if k_descale is not None:
        k_b = k_b * k_descale[request].to(compute_dtype)[None, :, None]
    if v_descale is not None:
        v_b = v_b * v_descale[request].to(compute_dtype)[None, :, None]
    return q_b, k_b, v_b


def masked_softmax(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention of rows over columns whose masked logits are ``-inf``.

    Args:
        logits: ``(R, N)`` scaled logits; ``-inf`` marks a column the row may not see.
        values: ``(N, d)`` one value vector per column.

    Returns:
        ``out (R, d)`` and ``lse (R,)`` (natural log of the sum of ``exp(logits)``).
        A row without any visible column gets ``out = 0`` and ``lse = -inf``
        rather than the NaN of a 0/0 softmax.
    """
    row_max = logits.amax(dim=1, keepdim=True) if logits.shape[1] else logits.new_full((logits.shape[0], 1), -math.inf)
    # Shift by the row maximum for stability; a fully masked row has max -inf, shift it by 0 instead.
    shift = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    probs = torch.exp(logits - shift)
    denom = probs.sum(dim=1, keepdim=True)
    out = (probs @ values) / torch.where(denom > 0, denom, torch.ones_like(denom))
    lse = (shift + torch.log(denom)).squeeze(1)  # log(0) = -inf for empty rows
    return out, lse


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention of a varlen batch over its paged KV cache (the dense reference).

    Query ``i`` of request ``b`` sits at absolute position ``prefix_b + i`` and sees
    keys ``0 .. prefix_b + i`` (bottom-right causal alignment). Query positions are
    processed in chunks of :data:`QUERY_CHUNK_ROWS` packed rows, so memory stays
    bounded at long context.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache, v_cache: ``(num_pages, page_size, Hkv, d)`` paged cache.
        batch: the batch metadata.
        softmax_scale: scale of the logits, ``1 / sqrt(d)`` by default.
        compute_dtype: float32 or float64, the dtype of every product and sum.
        q_descale, k_descale, v_descale: ``(B, Hkv) float32`` descales, required
            for (and only for) ``float8_e4m3fn`` inputs.
        return_lse: also return the log-sum-exp of each row.

    Returns:
        ``out (total_q, Hq, d)`` in ``compute_dtype``; with ``return_lse`` also
        ``lse (total_q, Hq) float32`` (natural log, of the scaled logits).
        Rows of zero-length requests simply do not exist.

    Raises:
        TypeError, ValueError: invalid inputs (see :func:`validate_prefill_inputs`)
            or an unsupported ``compute_dtype`` / ``softmax_scale``.
    """
    shapes = validate_prefill_inputs(
        q, k_cache, v_cache, batch, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
    )
    check_compute_dtype(compute_dtype)
    scale = resolve_scale(softmax_scale, shapes.head_dim)
    group = shapes.group
    out = torch.zeros(q.shape[0], shapes.num_q_heads, shapes.head_dim, dtype=compute_dtype, device=q.device)
    lse = torch.full((q.shape[0], shapes.num_q_heads), -math.inf, dtype=torch.float32, device=q.device)
    positions_per_chunk = max(1, QUERY_CHUNK_ROWS // group)
    host = batch.host

    for b in range(batch.num_requests):
        q_len, prefix, start = host.q_lens[b], host.prefix[b], host.cu_seqlens_q[b]
        if q_len == 0:
            continue
        q_b, k_b, v_b = request_operands(
            q, k_cache, v_cache, batch, b, shapes, compute_dtype, (q_descale, k_descale, v_descale)
        )
        for h in range(shapes.num_kv_heads):
            rows = pack_queries(q_b, group, h)  # (q_len * g, d), row r = (position r // g, head h*g + r % g)
            for p0 in range(0, q_len, positions_per_chunk):
                p1 = min(p0 + positions_per_chunk, q_len)
                # The chunk's last query sees keys 0 .. prefix + p1 - 1: later keys are never needed.
                visible = prefix + p1
                keys, values = k_b[:visible, h], v_b[:visible, h]
                logits = (rows[p0 * group : p1 * group] @ keys.T) * scale
                query_pos = prefix + torch.arange(p0, p1, device=q.device).repeat_interleave(group)
                key_pos = torch.arange(visible, device=q.device)
                logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], -math.inf)
                chunk_out, chunk_lse = masked_softmax(logits, values)
                heads = slice(h * group, (h + 1) * group)
                out[start + p0 : start + p1, heads] = unpack_rows(chunk_out, group)
                lse[start + p0 : start + p1, heads] = unpack_rows(chunk_lse, group).float()
    return (out, lse) if return_lse else out
