"""One layer of SGLang's MHA KV pool seen as the fpv2 paged cache ``(num_pages, page_size, Hkv, d)``.

``MHATokenToKVPool`` stores each layer's keys (and values) either as token
rows ``(size + page_size, Hkv, d)`` (the default NHD layout) or, with
``SGLANG_USE_HND_KVCACHE``, as pages ``(num_pages, Hkv, page_size, d)``.
Both are viewed without a copy: NHD rows are regrouped into pages, HND pages
have their head and token axes swapped (a strided view). Slot ``s`` of the pool
is ``(page s // page_size, offset s % page_size)`` in the view.
"""

from __future__ import annotations

import torch


def paged_cache_view(
    buffer: torch.Tensor,
    *,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    name: str = "key buffer",
) -> torch.Tensor:
    """The ``(num_pages, page_size, Hkv, d)`` view of one layer's KV buffer.

    Args:
        buffer: ``get_key_buffer(layer_id)`` or ``get_value_buffer(layer_id)``:
            ``(slots, Hkv, d)`` (NHD) or ``(num_pages, Hkv, page_size, d)`` (HND).
        page_size: tokens per page of the pool.
        num_kv_heads: the layer's local KV heads (``layer.tp_k_head_num``).
        head_dim: the layer's head dimension.
        name: what ``buffer`` is, for messages.

    Returns:
        A view sharing ``buffer``'s storage (NHD: trailing slots that do not fill
        a page are left out; they are never a page's slot).

    Raises:
        TypeError: ``buffer`` is not a tensor.
        ValueError: ``page_size`` is not a positive int, the layout is not one of the two above, the heads or head
            dimension differ from the layer's, or the rows cannot be regrouped
            without a copy.
    """
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{name} must be a tensor; got {type(buffer).__name__}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int; got {page_size!r}")
    shape = tuple(buffer.shape)
    if buffer.dim() == 3:
        rows, heads, dim = shape
        _check_heads(name, shape, heads, dim, num_kv_heads, head_dim)
        usable = rows - rows % page_size
        try:
            return buffer[:usable].view(usable // page_size, page_size, heads, dim)
        except RuntimeError as exc:
            raise ValueError(
                f"{name} of shape {shape} and strides {tuple(buffer.stride())} cannot be viewed as pages of "
                f"{page_size} tokens without a copy"
            ) from exc
    if buffer.dim() == 4:
        _, heads, tokens, dim = shape
        if tokens != page_size:
            raise ValueError(
                f"{name} has the HND shape {shape} (num_pages, Hkv, page_size, d) but the pool's page size is "
                f"{page_size}"
            )
        _check_heads(name, shape, heads, dim, num_kv_heads, head_dim)
        return buffer.permute(0, 2, 1, 3)
    raise ValueError(
        f"{name} has shape {shape} dtype {buffer.dtype}; fpv2 reads MHA pools laid out as (slots, Hkv, d) or "
        f"(num_pages, Hkv, page_size, d), not other layouts (e.g. AITER's vectorized_5d)"
    )


def _check_heads(name: str, shape: tuple, heads: int, dim: int, num_kv_heads: int, head_dim: int) -> None:
    """Refuse a buffer whose KV heads or head dimension differ from the layer's local ones."""
    if heads != num_kv_heads or dim != head_dim:
        raise ValueError(
            f"{name} of shape {shape} holds {heads} KV heads of dimension {dim}, but the layer has "
            f"tp_k_head_num={num_kv_heads} local KV heads of dimension {head_dim}"
        )
