"""Dense per-row K/V of a transformers layer seen as a paged KV cache, without a copy.

transformers hands an attention function ``key``/``value`` of shape
``(B, Hkv, T, d)``: one dense row of ``T`` cache slots per batch row (the whole
buffer of a static cache, or exactly the keys seen so far for a dynamic one).
The fpv2 pipeline reads a paged cache ``(num_pages, page_size, Hkv, d)``
through a page table. This module builds that paged view over the same memory
with :meth:`torch.Tensor.as_strided`: page ``p`` starts ``p * page_size`` slots
after the first slot of the tensor, so row ``b``'s page ``j`` has id
``b * row_pages + j`` with ``row_pages = stride(0) / (page_size * stride(2))``.
Page ids between two rows alias the other heads' memory; no page table entry
points at them, and nothing reads them.

The page size is the largest power of two up to :data:`MAX_PAGE_SIZE` that
divides the KV length and the row stride, so a 16K prompt is read in 128-token
pages (one page id per block in the kernels) and an odd length in pages of 1
(the identity page table). Only these few page sizes occur, which bounds the
number of kernel specialisations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from fpv2.kernel import PagedPrefillBatch

#: Largest page size of the view (the kernels' key block).
MAX_PAGE_SIZE = 128


@dataclass(frozen=True, eq=False)
class PagedKVView:
    """A paged view of dense K/V rows and the batch that reads it.

    Attributes:
        k_cache: ``(num_pages, page_size, Hkv, d)`` view of the keys (no copy unless
            the input strides made one necessary, see :func:`dense_kv_as_pages`).
        v_cache: the matching view of the values.
        batch: one request per batch row, ``q_len`` queries over ``kv_len`` keys
            (bottom-right causal: prefix ``kv_len - q_len``).
        copied: whether K/V had to be copied into a contiguous layout first.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    batch: PagedPrefillBatch
    copied: bool


def page_size_for(kv_len: int, row_slots: int | None) -> int:
    """The largest power of two ``<= MAX_PAGE_SIZE`` dividing ``kv_len`` (and ``row_slots``).

    Args:
        kv_len: keys per row that the pages must cover exactly.
        row_slots: distance between two rows in slots (``stride(0) / stride(2)``),
            or None for a single row.

    Returns:
        The page size (1 when ``kv_len`` is odd).

    Raises:
        ValueError: ``kv_len`` is not positive.
    """
    if kv_len <= 0:
        raise ValueError(f"kv_len must be positive; got {kv_len}")
    size = MAX_PAGE_SIZE
    while size > 1 and (kv_len % size or (row_slots is not None and row_slots % size)):
        size //= 2
    return size


def _row_slots(t: torch.Tensor) -> int | None:
    """Slots between rows of ``t (B, Hkv, T, d)`` when they are a whole number, else -1; None for one row."""
    if t.shape[0] == 1:
        return None
    slot = t.stride(2)
    if slot <= 0 or t.stride(0) % slot:
        return -1
    return t.stride(0) // slot


def dense_kv_as_pages(key: torch.Tensor, value: torch.Tensor, q_len: int, kv_len: int) -> PagedKVView:
    """View the first ``kv_len`` slots of each row of ``key``/``value`` as a paged cache.

    Args:
        key: ``(B, Hkv, T, d)`` keys, ``T >= kv_len``, unit stride in ``d``.
        value: ``(B, Hkv, T, d)`` values.
        q_len: queries per row (the last ``q_len`` of the ``kv_len`` keys' positions).
        kv_len: keys per row that the queries see (bottom-right causal).

    Returns:
        The :class:`PagedKVView`. K/V are copied into ``(B, kv_len, Hkv, d)``
        contiguous memory only when their strides do not allow a view (K and V
        with different strides, a non-unit stride in ``d``, or rows that are not a
        whole number of slots apart).

    Raises:
        TypeError: ``key`` or ``value`` is not a tensor.
        ValueError: shapes or lengths are inconsistent (named, with shapes).
    """
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, Hkv, T, d); got {tuple(t.shape)} ({t.dtype})")
    if key.shape != value.shape:
        raise ValueError(f"key and value must have one shape; got {tuple(key.shape)} and {tuple(value.shape)}")
    batch_size, num_kv_heads, slots, head_dim = key.shape
    if not 0 < q_len <= kv_len <= slots:
        raise ValueError(
            f"need 0 < q_len <= kv_len <= T; got q_len={q_len}, kv_len={kv_len}, key {tuple(key.shape)} ({key.dtype})"
        )
    copied = False
    rows = _row_slots(key)
    viewable = key.stride() == value.stride() and key.stride(3) == 1 and key.stride(2) > 0 and rows != -1
    if not viewable:
        # (B, kv_len, Hkv, d) contiguous: consecutive slots of a row are consecutive tokens.
        key = key[:, :, :kv_len].transpose(1, 2).contiguous().transpose(1, 2)
        value = value[:, :, :kv_len].transpose(1, 2).contiguous().transpose(1, 2)
        rows = _row_slots(key)
        copied = True
    page_size = page_size_for(kv_len, rows)
    row_pages = 0 if rows is None else rows // page_size
    pages_per_row = kv_len // page_size
    num_pages = (batch_size - 1) * row_pages + pages_per_row
    size = (num_pages, page_size, num_kv_heads, head_dim)
    slot = key.stride(2)
    stride = (page_size * slot, slot, key.stride(1), 1)
    k_cache = key.as_strided(size, stride, key.storage_offset())
    v_cache = value.as_strided(size, stride, value.storage_offset())
    batch = _uniform_batch(batch_size, q_len, kv_len, page_size, row_pages, num_pages, key.device)
    return PagedKVView(k_cache=k_cache, v_cache=v_cache, batch=batch, copied=copied)


@lru_cache(maxsize=32)
def _uniform_batch(
    batch_size: int, q_len: int, kv_len: int, page_size: int, row_pages: int, num_pages: int, device: torch.device
) -> PagedPrefillBatch:
    """The batch of ``batch_size`` equal requests; cached so that every layer of a forward shares one.

    Sharing matters: the batch reads its lengths on the host once (``batch.host``),
    so the layers after the first cost no device synchronisation for it.
    """
    pages_per_row = kv_len // page_size
    cu = torch.arange(batch_size + 1, dtype=torch.int32) * q_len
    seqlens_k = torch.full((batch_size,), kv_len, dtype=torch.int32)
    table = torch.arange(batch_size, dtype=torch.int32)[:, None] * row_pages + torch.arange(
        pages_per_row, dtype=torch.int32
    )
    batch = PagedPrefillBatch(
        cu_seqlens_q=cu,
        seqlens_k=seqlens_k,
        page_table=table,
        page_size=page_size,
        num_pages=num_pages,
    )  # validated once, on the host, where it costs no device sync
    return batch.to(device) if device.type != "cpu" else batch
