"""Reading a request's keys and values out of the paged cache."""

from __future__ import annotations

import torch

from ..contracts import PagedPrefillBatch


def token_slots(batch: PagedPrefillBatch, request: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page ids, in-page offsets)`` of the request's KV tokens ``0 .. seqlens_k[b]-1``."""
    kv_len = batch.host.seqlens_k[request]
    pos = torch.arange(kv_len, device=batch.device)
    pages = batch.page_table[request].long()[pos // batch.page_size]
    return pages, pos % batch.page_size


def gather_kv(cache: torch.Tensor, batch: PagedPrefillBatch, request: int) -> torch.Tensor:
    """The request's ``(seqlens_k[b], Hkv, d)`` keys (or values), in token order."""
    pages, offsets = token_slots(batch, request)
    return cache[pages, offsets]
