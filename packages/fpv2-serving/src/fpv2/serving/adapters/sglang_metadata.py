"""The fpv2 prefill batch of one SGLang forward, built from its ``ForwardBatch`` and ``req_to_token``.

SGLang keeps, per request row of ``ReqToTokenPool.req_to_token``, the KV-pool
slot of every token of the request. With page size ``p`` the pool allocates
whole pages, so token ``i`` of a request lives in slot ``page * p + i % p``
with ``page = req_to_token[row, i - i % p] // p``: the page table is the slot
of every ``p``-th token divided by ``p``. This module reads only tensors and
plain attributes of the batch (no SGLang import), so it is cheap to test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fpv2.kernel import PagedPrefillBatch

from ..chunk_state_registry import ChunkRequest

#: Page-table entry past a request's last page (ignored by every fpv2 stage).
NO_PAGE = -1


@dataclass(frozen=True, eq=False)
class SGLangPrefillMetadata:
    """What one SGLang extend forward needs from fpv2, built once and shared by all layers.

    Attributes:
        batch: the paged prefill batch (query offsets from ``extend_seq_lens``,
            KV lengths from ``seq_lens``, page table from ``req_to_token``).
        prefix: ``(B,) int32`` cached prefix per request (``extend_prefix_lens``);
            equal to ``batch.prefix``.
        forward_mode: the batch's ``ForwardMode``, for the per-layer checks.
        chunk_requests: each request's chunk (id, prefix, length, prompt length) when the forward
            runs through the chunk-aware pipeline, else None (the plain per-call pipeline).
    """

    batch: PagedPrefillBatch
    prefix: torch.Tensor
    forward_mode: object
    chunk_requests: tuple[ChunkRequest, ...] | None = None


def page_table_from_req_to_token(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    page_size: int,
    max_seq_len: int,
) -> torch.Tensor:
    """Page ids of each request: the slot of every ``page_size``-th token, divided by ``page_size``.

    Args:
        req_to_token: ``(rows, max_context_len) int32`` token slots per request row.
        req_pool_indices: ``(B,)`` request rows of this batch.
        seq_lens: ``(B,)`` KV length per request (prefix included).
        page_size: tokens per page of the KV pool.
        max_seq_len: an upper bound of ``seq_lens`` known on the host (sizes the table).

    Returns:
        ``(B, max(1, ceil(max_seq_len / page_size))) int32`` page table, rows
        contiguous, :data:`NO_PAGE` past each request's last page.

    Raises:
        TypeError, ValueError: bad shapes, dtypes or sizes (named in the message).
    """
    if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be a 2-D tensor; got {_describe(req_to_token)}")
    if req_to_token.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"req_to_token must hold int32 or int64 slots; got {_describe(req_to_token)}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int; got {page_size!r}")
    max_context_len = req_to_token.shape[1]
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 0 <= max_seq_len <= max_context_len:
        raise ValueError(
            f"max_seq_len must be an int in [0, {max_context_len}] (req_to_token has {_describe(req_to_token)}); "
            f"got {max_seq_len!r}"
        )
    device = req_to_token.device
    rows = req_pool_indices.to(device=device, dtype=torch.long)
    lengths = seq_lens.to(device=device, dtype=torch.long)
    if rows.dim() != 1 or lengths.shape != rows.shape:
        raise ValueError(
            f"req_pool_indices and seq_lens must be (B,) tensors of one length; "
            f"got {_describe(req_pool_indices)} and {_describe(seq_lens)}"
        )
    max_pages = max(1, -(-max_seq_len // page_size))
    # Column j*p is the first token of page j; j*p < max_seq_len <= max_context_len for every used page.
    first_tokens = torch.arange(max_pages, device=device, dtype=torch.long) * page_size
    first_tokens.clamp_(max=max_context_len - 1)
    slots = req_to_token[rows[:, None], first_tokens[None, :]].to(torch.int64)
    pages_needed = (lengths + page_size - 1) // page_size
    used = torch.arange(max_pages, device=device)[None, :] < pages_needed[:, None]
    table = torch.where(used, slots // page_size, torch.full_like(slots, NO_PAGE))
    return table.to(torch.int32).contiguous()


def build_prefill_metadata(
    forward_batch: object,
    req_to_token: torch.Tensor,
    *,
    page_size: int,
    num_pages: int,
    validate: bool = True,
) -> SGLangPrefillMetadata:
    """The fpv2 metadata of an SGLang extend ``ForwardBatch``.

    Reads ``req_pool_indices``, ``seq_lens`` (and ``seq_lens_cpu`` when present,
    to size the page table without a device synchronisation),
    ``extend_seq_lens``, ``extend_prefix_lens`` (None: ``seq_lens - extend_seq_lens``)
    and ``forward_mode``. Index tensors are moved to ``req_to_token``'s device.

    Args:
        forward_batch: an SGLang ``ForwardBatch`` in an extend mode.
        req_to_token: ``ReqToTokenPool.req_to_token``.
        page_size: tokens per page of the KV pool.
        num_pages: pages of the per-layer KV cache view (upper bound of page ids).
        validate: check the values on the host: ``seq_lens == extend_prefix_lens
            + extend_seq_lens`` and every used page id in ``[0, num_pages)``.

    Returns:
        The :class:`SGLangPrefillMetadata`.

    Raises:
        ValueError: a field is missing or inconsistent (named in the message).
    """
    req_pool_indices = _field(forward_batch, "req_pool_indices")
    seq_lens = _field(forward_batch, "seq_lens")
    extend_seq_lens = _field(forward_batch, "extend_seq_lens")
    device = req_to_token.device
    seqlens_k = seq_lens.to(device=device, dtype=torch.int32)
    q_lens = extend_seq_lens.to(device=device, dtype=torch.int32)
    if seqlens_k.dim() != 1 or q_lens.shape != seqlens_k.shape:
        raise ValueError(
            f"ForwardBatch.seq_lens and extend_seq_lens must be (B,) tensors of one length; "
            f"got {_describe(seq_lens)} and {_describe(extend_seq_lens)}"
        )
    prefix_field = getattr(forward_batch, "extend_prefix_lens", None)
    prefix = (seqlens_k - q_lens) if prefix_field is None else prefix_field.to(device=device, dtype=torch.int32)
    if prefix.shape != seqlens_k.shape:
        raise ValueError(
            f"ForwardBatch.extend_prefix_lens must be a (B,) tensor like seq_lens; got {_describe(prefix_field)}"
        )
    if validate:
        mismatch = seqlens_k != prefix + q_lens
        if bool(mismatch.any()):
            b = int(torch.nonzero(mismatch)[0])
            raise ValueError(
                f"request {b}: ForwardBatch.seq_lens[{b}]={int(seqlens_k[b])} != extend_prefix_lens[{b}]="
                f"{int(prefix[b])} + extend_seq_lens[{b}]={int(q_lens[b])}"
            )
    seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if seq_lens_cpu is not None and seq_lens_cpu.numel() == seqlens_k.numel():
        max_seq_len = int(seq_lens_cpu.max()) if seq_lens_cpu.numel() else 0
    else:
        max_seq_len = int(seqlens_k.max()) if seqlens_k.numel() else 0  # device sync: no host mirror
    page_table = page_table_from_req_to_token(
        req_to_token, req_pool_indices, seqlens_k, page_size=page_size, max_seq_len=max_seq_len
    )
    cu_seqlens_q = torch.zeros(q_lens.numel() + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = torch.cumsum(q_lens, dim=0, dtype=torch.int32)
    batch = PagedPrefillBatch(
        cu_seqlens_q=cu_seqlens_q,
        seqlens_k=seqlens_k.contiguous(),
        page_table=page_table,
        page_size=page_size,
        num_pages=num_pages,
        check_values=validate,
    )
    return SGLangPrefillMetadata(
        batch=batch, prefix=prefix.contiguous(), forward_mode=getattr(forward_batch, "forward_mode", None)
    )


def chunk_requests_of(forward_batch: object) -> tuple[ChunkRequest, ...] | None:
    """Each request's chunk of an SGLang extend ``ForwardBatch``, for the chunk-aware pipeline.

    Reads ``rids``, ``extend_prefix_lens_cpu`` and ``extend_seq_lens_cpu`` (host lists) and
    ``orig_seq_lens`` (the prompt length SGLang keeps per request, ``max(extend_end,
    len(origin_input_ids))``; a device tensor, copied to the host here). A request whose
    ``orig_seq_lens`` is shorter than its KV after the chunk (a decode row of a mixed batch)
    gets that KV length as its prompt length: its chunk ends its prefill.

    Args:
        forward_batch: an SGLang ``ForwardBatch`` in an extend mode.

    Returns:
        One :class:`~fpv2.serving.chunk_state_registry.ChunkRequest` per request, or None when the
        batch lacks request ids or the host lengths, or when they disagree in length (a batch padded
        for data-parallel attention pads its tensors, not its ids): the forward then runs the
        per-call pipeline, whose output does not depend on them.
    """
    rids = getattr(forward_batch, "rids", None)
    prefixes = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    q_lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if rids is None or prefixes is None or q_lens is None:
        return None
    orig = getattr(forward_batch, "orig_seq_lens", None)
    prompt_lens = [None] * len(rids) if orig is None else [int(n) for n in orig.tolist()]
    if not len(rids) == len(prefixes) == len(q_lens) == len(prompt_lens):
        return None
    return tuple(
        ChunkRequest(
            key=rid,
            prefix=int(p),
            q_len=int(n),
            prompt_len=None if total is None else max(total, int(p) + int(n)),
        )
        for rid, p, n, total in zip(rids, prefixes, q_lens, prompt_lens)
    )


def _field(forward_batch: object, name: str) -> torch.Tensor:
    """A required tensor field of the batch, or a ValueError naming it."""
    value = getattr(forward_batch, name, None)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"ForwardBatch.{name} must be a tensor for an fpv2 extend forward; got {value!r}")
    return value


def _describe(value: object) -> str:
    """Shape and dtype of a tensor, or the type of anything else, for messages."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} dtype {value.dtype}"
    return f"{type(value).__name__}"
