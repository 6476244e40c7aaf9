"""The attention mask of ``attn_implementation="fpv2"``: how it is made and how it is read.

transformers builds one mask per forward with the function registered under the
attention implementation's name in ``AttentionMaskInterface`` (without one, it
passes no mask at all and padding would be silently ignored). fpv2 registers
:func:`fpv2_mask`, which makes exactly the mask of ``"sdpa"``:

- ``None`` when the attention is plainly causal and sdpa's ``is_causal`` covers
  it: no padding, and either ``q_len == kv_len`` (prefill), ``q_len == 1``
  (decode), or an empty static cache (``q_len < kv_len``, the unused slots
  lie after the queries: causal from the top-left, i.e. over the first
  ``q_len`` keys);
- otherwise a ``(B, 1, q_len, kv_len)`` boolean mask (True = attend): prefill
  on top of a cached prefix, padding, packed sequences, sliding windows, ...

Keeping sdpa's mask makes the dense fallback exact: a call the fpv2 pipeline
cannot serve goes to transformers' own sdpa function with the very mask sdpa
would have had. :func:`causal_key_length` reads a boolean mask back and says
whether the pipeline can serve it (a padding-free, bottom-right causal mask,
possibly followed by unused cache slots).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def fpv2_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function of ``attn_implementation="fpv2"`` (``AttentionMaskInterface``): sdpa's mask.

    Args:
        batch_size: rows of the batch.
        q_length: queries per row in this forward.
        kv_length: key slots per row the attention will see.
        q_offset: position of the first query (tokens already cached).
        kv_offset: position of the first key slot.
        mask_function: transformers' mask pattern (causal by default).
        attention_mask: the 2D padding mask ``(B, seen + q_length)`` or None.
        **kwargs: the other keyword arguments transformers passes to mask
            functions (``allow_is_causal_skip``, ``device``, ``config``, ...).

    Returns:
        None (plainly causal, see the module docstring) or a ``(B, 1, q_length,
        kv_length) bool`` mask, exactly as ``transformers.masking_utils.sdpa_mask``.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    kwargs.pop("dtype", None)  # meant for eager's float masks; sdpa's are boolean
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=causal_mask_function if mask_function is None else mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


class _LastMask:
    """The verdict on the last mask read, so the layers of one forward read their shared mask once."""

    def __init__(self) -> None:
        self.ref: weakref.ref | None = None
        self.q_len = -1
        self.verdict: int | None = None

    def get(self, mask: torch.Tensor, q_len: int) -> tuple[bool, int | None]:
        hit = self.ref is not None and self.ref() is mask and self.q_len == q_len
        return hit, self.verdict if hit else None

    def put(self, mask: torch.Tensor, q_len: int, verdict: int | None) -> None:
        self.ref, self.q_len, self.verdict = weakref.ref(mask), q_len, verdict


_LAST = _LastMask()


def causal_key_length(mask: torch.Tensor, q_len: int) -> int | None:
    """Whether a boolean 4D mask is a padding-free bottom-right causal mask, and over how many keys.

    The mask qualifies when every row and head equals the causal pattern of
    ``q_len`` queries at positions ``L - q_len .. L - 1`` over keys ``0 .. L - 1``,
    with key slots ``L ..`` masked out for every query (unused static-cache
    slots). Anything else (padding, packed sequences, sliding windows, float
    masks) does not. The verdict for the last mask tensor is remembered, so the
    layers of one forward, which share their mask, check it once (two host
    synchronisations).

    Args:
        mask: ``(B, 1 or H, q_len, kv_len)`` mask from :func:`fpv2_mask`.
        q_len: queries per row.

    Returns:
        ``L`` (the keys each row sees, ``q_len <= L <= kv_len``), or None when the
        mask is not such a causal mask.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        return None
    if mask.shape[2] != q_len or mask.shape[3] < q_len:
        return None
    hit, verdict = _LAST.get(mask, q_len)
    if hit:
        return verdict
    kv_slots = mask.shape[3]
    # The last query sees every real key: their count is L (read from the first row; all must agree).
    length = int(mask[0, 0, -1].sum())
    verdict = None
    if q_len <= length <= kv_slots:
        device = mask.device
        query_pos = torch.arange(length - q_len, length, device=device)
        expected = torch.arange(kv_slots, device=device)[None, :] <= query_pos[:, None]
        if bool((mask == expected).all()):
            verdict = length
    _LAST.put(mask, q_len, verdict)
    return verdict
