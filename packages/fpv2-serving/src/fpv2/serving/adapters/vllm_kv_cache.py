"""vLLM v1's paged KV cache read as it is, and the KV write with vLLM's slot semantics.

In vLLM 0.33 every attention layer's cache is one tensor of logical shape
``(num_blocks, num_kv_heads, block_size, 2 * head_size)``: per (block, head,
slot) the key's ``head_size`` elements followed by the value's. Its physical
order is a per-run choice (``KVCacheLayout``: token-major ``NHD`` or
head-major ``HND`` inside a block, layers outside or inside blocks), which
only changes the strides. vLLM's own flash-attention and Triton backends read
it as ``kv_cache.transpose(1, 2).split(head_size, -1)``: two strided views of
shape ``(num_blocks, block_size, num_kv_heads, head_size)`` with unit stride
in ``head_size``. That is fpv2's paged cache layout ``(num_pages, page_size,
Hkv, d)``, so the fpv2 kernels (which take strides) read vLLM's cache without
a copy.

Token ``i`` of a step is stored at ``slot_mapping[i] = block * block_size +
offset``; a negative slot means "do not store" (padding), and rows of
``key``/``value`` past ``slot_mapping``'s length are padding too. That is the
contract of vLLM's ``reshape_and_cache_flash``; :func:`write_kv_cache` is its
pure-PyTorch equivalent, used where vLLM's CUDA/Triton ops cannot run (CPU).

This module does not import vLLM.
"""

from __future__ import annotations

import torch


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}, strides {tuple(t.stride())}"


def kv_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views of one layer's vLLM cache in fpv2's paged layout (no copy).

    Args:
        kv_cache: ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` logical
            view (any of vLLM's physical layouts), unit stride in the last dimension.
        head_size: ``d``.

    Returns:
        ``(k_cache, v_cache)``, each ``(num_blocks, block_size, num_kv_heads, head_size)``.

    Raises:
        TypeError: ``kv_cache`` is not a tensor or ``head_size`` not an int.
        ValueError: wrong rank, last dimension not ``2 * head_size``, or non-unit
            stride in it.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache must be a torch.Tensor; got {type(kv_cache).__name__}")
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise TypeError(f"head_size must be a positive int; got {head_size!r}")
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(
            f"kv_cache must have vLLM's logical shape (num_blocks, num_kv_heads, block_size, 2 * head_size = "
            f"{2 * head_size}); got {_describe(kv_cache)}"
        )
    if kv_cache.numel() and kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must have unit stride in its last dimension; got {_describe(kv_cache)}")
    k_cache, v_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k_cache, v_cache


#: vLLM's physical orders inside a block: token-major (its default) and head-major.
KV_CACHE_LAYOUTS = ("NHD", "HND")


def paged_as_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str = "NHD") -> torch.Tensor:
    """Paged K and V copied into one vLLM-style layer cache (the inverse of :func:`kv_cache_views`).

    For benchmarks and tests that run the pipeline on the caches vLLM hands over:
    ``kv_cache_views(paged_as_kv_cache(k, v, layout), d)`` equals ``(k, v)`` in value, with
    vLLM's strides: head stride ``2 d`` for ``NHD`` (token-major inside a block), token
    stride ``2 d`` and head stride ``block_size * 2 d`` for ``HND`` (head-major).

    Args:
        k_cache: ``(num_blocks, block_size, num_kv_heads, head_size)`` paged keys.
        v_cache: paged values, same shape and dtype.
        layout: ``"NHD"`` or ``"HND"`` (:data:`KV_CACHE_LAYOUTS`).

    Returns:
        A new ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` logical view of a
        contiguous buffer in that physical order.

    Raises:
        TypeError: a cache is not a tensor, or the dtypes differ.
        ValueError: the shapes differ or are not 4-D, or an unknown layout.
    """
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must share one (num_blocks, block_size, num_kv_heads, head_size) shape; got "
            f"{_describe(k_cache)} and {_describe(v_cache)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache must have k_cache's dtype; got {_describe(k_cache)} and {_describe(v_cache)}")
    if layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_CACHE_LAYOUTS}; got {layout!r}")
    both = torch.cat([k_cache, v_cache], dim=-1)  # (blocks, block_size, Hkv, 2 d): token-major
    if layout == "HND":
        return both.transpose(1, 2).contiguous()
    return both.transpose(1, 2)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys and values at their slots, as vLLM's ``reshape_and_cache_flash`` does.

    Row ``i < len(slot_mapping)`` of ``key``/``value`` goes to block
    ``slot_mapping[i] // block_size``, offset ``slot_mapping[i] % block_size``;
    negative slots and rows past ``len(slot_mapping)`` are skipped. Only
    unquantised caches (``kv_cache_dtype="auto"``): the dtypes must match.

    Args:
        key: ``(num_tokens, num_kv_heads, head_size)`` new keys.
        value: new values, same shape.
        kv_cache: the layer's ``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` cache (written in place).
        slot_mapping: ``(n,)`` int32/int64 slots, ``n <= num_tokens``.

    Raises:
        TypeError: non-tensors, non-integer slots, or dtypes that differ from the cache's.
        ValueError: shapes disagree, or a slot lies beyond the cache (the
            message names it).
    """
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if key.dim() != 3:
        raise ValueError(f"key must have shape (num_tokens, num_kv_heads, head_size); got {_describe(key)}")
    head_size = key.shape[-1]
    k_cache, v_cache = kv_cache_views(kv_cache, head_size)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if key.shape[1] != num_kv_heads:
        raise ValueError(
            f"key must have {num_kv_heads} KV heads like kv_cache {_describe(kv_cache)}; got {_describe(key)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value must have the shape of key {tuple(key.shape)}; got {_describe(value)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != kv_cache.dtype:
            raise TypeError(
                f"{name} must have the cache's dtype {kv_cache.dtype} (quantised KV caches are not supported); "
                f"got {_describe(t)}"
            )
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.dim() != 1:
        raise TypeError(f"slot_mapping must be a 1-D int32/int64 tensor; got {_describe(slot_mapping)}")
    n = slot_mapping.shape[0]
    if n > key.shape[0]:
        raise ValueError(f"slot_mapping has {n} slots but key holds only {key.shape[0]} tokens ({_describe(key)})")
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    rows = torch.nonzero(slots >= 0).squeeze(1)  # negative slots are padding: not stored
    slots = slots[rows]
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        bad = int(slots.max())
        raise ValueError(
            f"slot_mapping holds slot {bad}, beyond the cache's {num_blocks} blocks x {block_size} slots "
            f"({_describe(kv_cache)})"
        )
    blocks, offsets = slots // block_size, slots % block_size
    # Indexed assignment into the strided views writes through to vLLM's tensor.
    k_cache[blocks, offsets] = key[rows]
    v_cache[blocks, offsets] = value[rows]
