"""One vLLM attention call split in two: decode rows to a dense delegate, prefill rows to fpv2.

The batch is reordered by vLLM (decodes first, see :mod:`.vllm_metadata`), so
the decode rows are the leading ``num_decode_tokens`` rows of ``query`` and
``output`` and the prefill rows the ``num_prefill_tokens`` after them. Rows
past both (padding) are left untouched, as vLLM's own backends do.

The prefill rows run the fpv2 pipeline over vLLM's paged cache read in place
(:func:`.vllm_kv_cache.kv_cache_views`). The decode rows are handed to a
callable, which the vLLM impl binds to vLLM's own dense backend (see
:mod:`.vllm_decode`). This module does not import vLLM, so the split and the
prefill math can be tested without it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..pipeline import PrefillResult, SparsePrefillPipeline
from .vllm_kv_cache import kv_cache_views
from .vllm_metadata import Fpv2VllmMetadata

#: ``decode(query_rows, output_rows)``: write dense attention of the decode rows into ``output_rows``.
DecodeFn = Callable[[torch.Tensor, torch.Tensor], None]
#: Sees every pipeline result: ``hook(result)``.
PrefillHook = Callable[[PrefillResult], None]


def forward_split_batch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: Fpv2VllmMetadata,
    output: torch.Tensor,
    *,
    head_size: int,
    pipeline: SparsePrefillPipeline,
    decode: DecodeFn | None,
    prefill_hook: PrefillHook | None = None,
) -> torch.Tensor:
    """Attention of one vLLM step: decode rows through ``decode``, prefill rows through ``pipeline``.

    Args:
        query: ``(num_tokens, Hq, d)`` packed queries (may hold padding rows at the end).
        kv_cache: the layer's vLLM cache, ``(num_blocks, Hkv, block_size, 2 * d)``;
            this step's keys and values are already in it.
        metadata: the step's :class:`~.vllm_metadata.Fpv2VllmMetadata`.
        output: ``(num_tokens, Hq, d)`` written in place (decode and prefill rows only).
        head_size: ``d``.
        pipeline: the fpv2 pipeline for the prefill rows.
        decode: writes the decode rows; may be None only when there are none.
        prefill_hook: called with each pipeline result (e.g. to record density).

    Returns:
        ``output``.

    Raises:
        TypeError: ``metadata`` is not a :class:`Fpv2VllmMetadata`.
        ValueError: ``query``/``output`` hold fewer rows than the batch, or the
            batch has prefill rows but no prefill metadata.
        RuntimeError: decode rows without a ``decode`` callable.
    """
    if not isinstance(metadata, Fpv2VllmMetadata):
        raise TypeError(f"metadata must be a Fpv2VllmMetadata; got {type(metadata).__name__}")
    split = metadata.split
    nd, npf = split.num_decode_tokens, split.num_prefill_tokens
    for name, t in (("query", query), ("output", output)):
        if t.dim() != 3 or t.shape[0] < nd + npf:
            raise ValueError(
                f"{name} must have shape (num_tokens >= {nd + npf}, num_heads, head_size) for "
                f"{nd} decode + {npf} prefill rows; got shape {tuple(t.shape)}, dtype {t.dtype}"
            )
    if nd:
        if decode is None:
            raise RuntimeError(f"the batch has {nd} decode rows but no dense decode path was given")
        decode(query[:nd], output[:nd])
    if npf:
        if metadata.prefill is None:
            raise ValueError(f"the batch has {npf} prefill rows but metadata.prefill is None")
        k_cache, v_cache = kv_cache_views(kv_cache, head_size)
        batch = metadata.prefill.batch(num_pages=k_cache.shape[0], page_size=k_cache.shape[1])
        result = pipeline(query[nd : nd + npf], k_cache, v_cache, batch)
        output[nd : nd + npf].copy_(result.out)
        if prefill_hook is not None:
            prefill_hook(result)
    return output
