"""When the Hopper backend copies a small-page cache into tile pages before its kernel.

Pages that are not a multiple of the kernel's 128-token KV tile (page size 1 is
SGLang's default) make the kernel gather K/V rows with cp.async, slower than its
TMA path; :func:`fpv2.kernel.triton.tile_repack.repack_to_tile_pages` copies the
call's keys and values once into 128-token pages so the kernel runs the TMA path
instead. The copy costs one read and one write of the call's KV (and that much
device memory while the kernel runs, 0.34 ms at 128K on the H200); the gather's
extra cost grows with the query tiles that read each block, the correction's
pooled tiles included. Measured on the H200 (2026-12-03, planted, 32/8 heads,
d = 128, page size 1, the corrected pipeline after a 128K KV): the copy paid at
every query share tried, 4K queries (1/32 of the keys) 2.59 against 3.14-3.34
ms, 16K 4.01-4.05 against 4.86, 32K 5.96-6.00 against 6.94-6.99, 64K 8.79-8.89
against 10.27-10.38; and (2026-12-04) 512 queries (1/256) 2.64-2.69 against
3.14-3.19 ms, 1K 2.26-2.47 against 2.73-2.74, 2K 2.40-2.58 against 2.94-2.99.
So the copy is made when a call's queries are at least :data:`MIN_QUERY_SHARE`
(1/256, the smallest share measured) of its keys; shorter chunks after a long
cached prefix keep the gather, unmeasured there. Caches the kernel cannot read
as they are (vLLM's K/V views) go to the Triton kernel below that share: the
copy with the Hopper kernel measured 2x faster than Triton at every chunk size
tried (512 queries after 128K keys: 2.26-2.51 against 5.02-5.07 ms).

Engines keep most of the device memory for their KV cache, so ``auto`` also
leaves the copy out when its two KV copies would take more than
:data:`MAX_MEMORY_SHARE` of the memory at hand (free to the driver plus what
PyTorch's allocator holds unused): the call then runs the gather, as fast as
before the copy existed, instead of failing for memory.

``FPV2_HOPPER_REPACK`` overrides the rule: ``auto`` (default), ``1`` (always for
small pages) or ``0`` (never). The copy is a Triton kernel: without Triton,
``auto`` keeps the gather and ``1`` is refused.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from fpv2.kernel import PagedPrefillBatch

#: Environment variable that overrides the rule.
REPACK_ENV = "FPV2_HOPPER_REPACK"
#: Queries per key from which ``auto`` copies: the smallest share at which the copy was measured to pay.
MIN_QUERY_SHARE = 1 / 256
#: Share of the memory at hand (:func:`repack_headroom_bytes`) the copies may take in ``auto``.
MAX_MEMORY_SHARE = 0.5
_MODES = ("auto", "0", "1")


def repack_headroom_bytes(device: torch.device) -> int | None:
    """Device memory the copies could take: free to the driver plus PyTorch's cached, unused blocks.

    Args:
        device: the cache's device.

    Returns:
        Bytes, or None off CUDA (no limit is applied there).
    """
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    # One read of the allocator's counters: memory_reserved and memory_allocated each flatten its whole
    # statistics tree in Python, most of should_repack's host time in the 2026-12-04 profile.
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return free + stats["reserved_bytes"]["all"]["current"] - stats["allocated_bytes"]["all"]["current"]


def repack_mode() -> str:
    """The mode from ``FPV2_HOPPER_REPACK``: ``"auto"`` when unset or empty, else ``"0"`` or ``"1"``.

    Raises:
        ValueError: any other value (named with the accepted ones).
    """
    value = os.environ.get(REPACK_ENV, "") or "auto"
    if value not in _MODES:
        raise ValueError(f"environment {REPACK_ENV}={value!r}: expected one of {', '.join(map(repr, _MODES))}")
    return value


def should_repack(
    batch: PagedPrefillBatch,
    kv_tile: int,
    mode: str | None = None,
    *,
    k_cache: torch.Tensor | None = None,
    kernel_reads_pages: bool = True,
) -> bool:
    """Whether a call on ``batch`` copies its KV into ``kv_tile``-token pages first.

    Args:
        batch: the call's batch (its cached host view gives the lengths).
        kv_tile: the kernel's KV tile; pages that are a multiple of it are not copied while
            ``kernel_reads_pages``.
        mode: ``"auto"``, ``"0"`` or ``"1"``; None reads :func:`repack_mode`.
        k_cache: the call's paged keys: with it, ``auto`` also checks that the copies fit
            (:data:`MAX_MEMORY_SHARE`); without it, the memory is not checked.
        kernel_reads_pages: False when the kernel cannot read the cache as it is (a strided
            view such as vLLM's or a transformers layer's): then pages of any size are copied
            under the same rule, the copy being the kernel's only way to them.

    Returns:
        True when the copy is made.

    Raises:
        ValueError: an unknown mode.
        ImportError: mode ``"1"`` without Triton installed.
    """
    if mode is None:
        mode = repack_mode()
    elif mode not in _MODES:
        raise ValueError(f"repack mode must be one of {', '.join(map(repr, _MODES))}; got {mode!r}")
    if kernel_reads_pages and batch.page_size % kv_tile == 0:
        return False
    verdict = _mode_verdict(mode)
    if verdict is not None:
        return verdict
    host = batch.host
    if host.cu_seqlens_q[-1] < MIN_QUERY_SHARE * sum(host.seqlens_k):
        return False
    if k_cache is None:
        return True
    from fpv2.kernel.triton.tile_repack import tile_repack_bytes

    return copies_fit(tile_repack_bytes(k_cache, batch), k_cache.device)


def copies_fit(needed: int, device: torch.device) -> bool:
    """Whether ``needed`` bytes of copies stay within :data:`MAX_MEMORY_SHARE` of :func:`repack_headroom_bytes`.

    The driver's free memory is part of the headroom and one cheap query (11 us of host time on the H200
    against 37 us for the whole headroom, 2026-12-04): when it alone suffices, the allocator's counters are
    not read.

    Args:
        needed: bytes the copies take.
        device: where they would be made; off CUDA there is no limit.

    Returns:
        True when the copies fit.
    """
    if device.type != "cuda":
        return True
    if needed <= MAX_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]:
        return True
    return needed <= MAX_MEMORY_SHARE * repack_headroom_bytes(device)


def should_carry_tile_pages(page_size: int, kv_tile: int, copy_bytes: int, device: torch.device) -> bool:
    """Whether a chunked prefill keeps one request's K/V in tile pages across its chunks.

    The carried copy (:mod:`fpv2.serving.chunked_tile_pages`) writes only the tokens each chunk adds,
    where the per-call copy of :func:`should_repack` rewrites the whole prefix every chunk; so it costs
    less than the per-call copy wherever that one was measured to pay, and ``auto`` makes it for every
    page size that is not a multiple of ``kv_tile`` when ``copy_bytes`` (the whole prompt's two copies,
    held until the prefill ends) fit :data:`MAX_MEMORY_SHARE` of the memory at hand.
    ``FPV2_HOPPER_REPACK`` applies as to the per-call copy: ``0`` never, ``1`` always.

    Args:
        page_size: the cache's tokens per page.
        kv_tile: the kernel's KV tile (pages that are a multiple of it are read as they are).
        copy_bytes: bytes of the two copies of the whole prompt.
        device: the cache's device.

    Returns:
        True when the copy is carried.

    Raises:
        ValueError: an unknown ``FPV2_HOPPER_REPACK``.
        ImportError: ``FPV2_HOPPER_REPACK=1`` without Triton installed.
    """
    if page_size % kv_tile == 0:
        return False
    verdict = _mode_verdict(repack_mode())
    return verdict if verdict is not None else copies_fit(copy_bytes, device)


def _mode_verdict(mode: str) -> bool | None:
    """What the mode decides alone: ``0`` never, ``1`` always (Triton required), ``auto`` without Triton never;
    None when ``auto``'s rule decides."""
    if mode == "0":
        return False
    has_triton = importlib.util.find_spec("triton") is not None
    if mode == "1":
        if not has_triton:
            raise ImportError(f"{REPACK_ENV}=1: the tile repack is a Triton kernel; install triton")
        return True
    return None if has_triton else False
