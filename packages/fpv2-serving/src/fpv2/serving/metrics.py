"""Accuracy and throughput metrics of the benchmark protocol (docs: BENCHMARKS.md)."""

from __future__ import annotations

import math

import torch

from fpv2.kernel import PagedPrefillBatch


def relative_l2_error(out: torch.Tensor, ref: torch.Tensor, chunk_rows: int | None = None) -> float:
    """``||out - ref|| / ||ref||`` over all elements, in fp64.

    Args:
        out: the output under test.
        ref: the reference output, same shape.
        chunk_rows: accumulate over chunks of this many rows of the last dimension, so that the fp64
            copies stay small for large tensors (e.g. the logits of a 64K-token prompt); None: at once.

    Returns:
        The relative L2 error (``||out - ref||`` when ``ref`` is zero).

    Raises:
        ValueError: the shapes differ.
    """
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape; got {tuple(out.shape)} and {tuple(ref.shape)}")
    o, r = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    step = o.shape[0] if chunk_rows is None else max(1, chunk_rows)
    num = torch.zeros((), dtype=torch.float64, device=out.device)
    den = torch.zeros((), dtype=torch.float64, device=out.device)
    for start in range(0, o.shape[0], step):
        r64 = r[start : start + step].double()
        num += (o[start : start + step].double() - r64).square().sum()
        den += r64.square().sum()
    num_f, den_f = float(num), float(den)
    return math.sqrt(num_f / den_f) if den_f else math.sqrt(num_f)


def select_rows(out: torch.Tensor, batch: PagedPrefillBatch, rows: list[torch.Tensor]) -> torch.Tensor:
    """Gather ``(n, d)`` output rows given per request as ``(position, query head)`` pairs.

    Args:
        out: ``(total_q, Hq, d)`` packed output.
        batch: the batch whose ``cu_seqlens_q`` locates each request.
        rows: per request, an ``(n_b, 2)`` long tensor of (query position, query head).

    Returns:
        The selected rows, concatenated over requests.
    """
    parts = []
    for b, pairs in enumerate(rows):
        if pairs.numel() == 0:
            continue
        pairs = pairs.to(out.device).long()
        parts.append(out[batch.host.cu_seqlens_q[b] + pairs[:, 0], pairs[:, 1]])
    if not parts:
        return out.new_zeros((0, out.shape[-1]))
    return torch.cat(parts)


def dense_causal_flops(seqlens_q: list[int], seqlens_k: list[int], num_q_heads: int, head_dim: int) -> float:
    """Dense-equivalent causal attention FLOPs, ``4 Hq Lq Lk d / 2`` summed over requests.

    For B requests of length L this is the reporting convention ``4 B Hq L^2 d / 2``.

    Args:
        seqlens_q: query length per request.
        seqlens_k: KV length per request.
        num_q_heads: ``Hq``.
        head_dim: ``d``.

    Returns:
        The FLOP count.
    """
    return sum(4.0 * num_q_heads * lq * lk * head_dim / 2 for lq, lk in zip(seqlens_q, seqlens_k))


def index_flops(seqlens_q: list[int], seqlens_k: list[int], num_q_heads: int, head_dim: int, block_size: int) -> float:
    """Scoring FLOPs of the index stage: every query row against the pooled keys it may see.

    Per request ``2 Hq Lq (Lk / Bk) d / 2`` (one multiply-add per element of
    ``q . kbar``, causal half), the cost model of ALGORITHM.md section 8.

    Args:
        seqlens_q: query length per request.
        seqlens_k: KV length per request.
        num_q_heads: ``Hq``.
        head_dim: ``d``.
        block_size: tokens per pooled block.

    Returns:
        The FLOP count.
    """
    return sum(2.0 * num_q_heads * lq * (lk / block_size) * head_dim / 2 for lq, lk in zip(seqlens_q, seqlens_k))


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds (0.0 for a non-positive time).

    Args:
        flops: work done.
        ms: time in milliseconds.

    Returns:
        The rate in TFLOP/s.
    """
    return flops / (ms * 1e-3) / 1e12 if ms > 0 else 0.0
