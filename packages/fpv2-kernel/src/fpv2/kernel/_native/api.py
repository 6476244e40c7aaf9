"""Python entry points over the C ABI: status handling, validation and the Hopper prefill."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re

import torch

from ..contracts import BLOCK_SIZE, BlockIndex, CorrectionPlan, PagedPrefillBatch
from ..reference.pooled_e4m3 import PooledE4M3
from .codes import Status
from .errors import HopperKernelNotBuiltError, NativeError, NativeLibraryError, UnsupportedConfigurationError
from .library import load_native_library, native_status
from .structs import _stream_handle, prefill_args_struct

#: Environment switch of the FP8 pooled products of the Hopper correction ("1" on; off by default: measured
#: no faster than the bf16 ones on the H200, benchmarks/NOTES.md 2026-12-01 fifth session).
POOLED_E4M3_ENV = "FPV2_HOPPER_POOLED_E4M3"
#: KV tokens per tile of the Hopper kernel, the key block of the contracts: it loads pages that are
#: multiples of it with TMA (other pages by a cp.async gather); only the TMA path serves the E4M3 copies.
HOPPER_KV_TILE = BLOCK_SIZE
#: Query tiles of the longest request (over its KV heads) from which the library runs a block-sparse call on the
#: persistent CTAs' tile queue in the kept-block work order when neither ``FPV2_HOPPER_PERSISTENT`` nor
#: ``FPV2_HOPPER_WORK_ORDER`` is set (csrc/hopper/schedule_default.hpp, kDefaultTileQueueMinRequestTiles): 24K
#: tokens at 32 query / 8 KV heads. Shorter chunks after a cached prefix run the work order alone.
DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES = 6144

#: Exception class per status code; codes not listed raise :class:`NativeError`.
_EXCEPTIONS: dict[int, type[Exception]] = {
    Status.INVALID_ARGUMENT: ValueError,
    Status.UNSUPPORTED: UnsupportedConfigurationError,
    Status.NOT_BUILT: HopperKernelNotBuiltError,
}


def _status_name(code: int) -> str:
    try:
        return Status(code).name
    except ValueError:
        return f"unknown status {code}"


def check_status(code: int, message: str | None = None) -> None:
    """Raise the Python exception matching a status code, carrying the library's message.

    Call it right after the ``fpv2_`` call, on the same thread: the message is the
    thread's last error of the library.

    Args:
        code: the returned ``fpv2_status_t``.
        message: the message to raise with; None reads ``fpv2_get_last_error()``.

    Raises:
        ValueError: ``FPV2_ERROR_INVALID_ARGUMENT``.
        UnsupportedConfigurationError: ``FPV2_ERROR_UNSUPPORTED`` (a ValueError).
        HopperKernelNotBuiltError: ``FPV2_ERROR_NOT_BUILT``.
        NativeError: any other non-zero code (CUDA, workspace, internal, unknown).
    """
    if code == Status.OK:
        return
    if message is None:
        try:
            lib = load_native_library()
            message = lib.fpv2_get_last_error().decode() or lib.fpv2_status_string(code).decode()
        except NativeLibraryError:
            message = ""
    message = message or f"libfpv2_kernel returned {_status_name(code)}"
    cls = _EXCEPTIONS.get(code)
    if cls is None:
        raise NativeError(message, int(code))
    exc = cls(message)
    exc.status = int(code)  # type: ignore[attr-defined]
    raise exc


def validate_prefill_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    index: BlockIndex | None = None,
    plan: CorrectionPlan | None = None,
    lse: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float = 0.0,
) -> None:
    """Check one prefill call's arguments with the library's validator (metadata only, no sync).

    All arguments are as for :func:`hopper_prefill`.

    Raises:
        ValueError: malformed or inconsistent arguments (the message names the field).
        UnsupportedConfigurationError: a configuration the kernel does not handle.
        NativeLibraryError: the library is not available.
    """
    lib = load_native_library()
    args = prefill_args_struct(
        q,
        k_cache,
        v_cache,
        out,
        batch,
        index=index,
        plan=plan,
        lse=lse,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        softmax_scale=softmax_scale,
    )
    check_status(lib.fpv2_validate_prefill(ctypes.byref(args)))


def hopper_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    index: BlockIndex | None = None,
    plan: CorrectionPlan | None = None,
    lse: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float = 0.0,
    stream: object = None,
    workspace: torch.Tensor | None = None,
    pooled_e4m3: bool | None = None,
) -> torch.Tensor:
    """Causal (block-sparse) paged prefill with the Hopper kernel of ``libfpv2_kernel``.

    Tensors must live on the CUDA device of ``q``; the call is asynchronous on
    ``stream``. The kernel serves bf16 inputs at the head dims it was built for
    (:func:`hopper_head_dims`: 64, 128 and 256), any page size (TMA tiles when it is a
    multiple of the KV tile, 128 tokens or 64 at d=256; a ``cp.async`` gather otherwise), block size 128, on sm_90
    devices; anything else is refused with :class:`UnsupportedConfigurationError`
    and a message naming the argument (for a head dim without an instantiation,
    the head dim and the built ones; nothing is launched). The plan's float32 pooled K/V are handed over as a
    bf16 copy (the kernel loads them with TMA): the statistics' own copies when they carry current ones (the
    Triton pooling writes them when asked, as the serving pipeline does with the correction on), else a
    conversion made here on every call. A library built without the
    kernel reports ``FPV2_ERROR_NOT_BUILT``, raised as
    :class:`HopperKernelNotBuiltError`.

    With ``pooled_e4m3`` on, the correction's pooled products run on FP8 tensor cores
    instead: the plan's pooled K/V are quantised once per call to E4M3 copies
    (:func:`fpv2.kernel.triton.pooled_e4m3.quantize_pooled_e4m3`, one Triton launch on
    ``stream``, no host sync; needs the ``triton`` extra) and no bf16 copy is made.
    That FP8 path serves page sizes that are multiples of 128 (the TMA path); other
    pages keep the bf16 pooled copies whatever the switch says.

    Args:
        q: ``(total_q, Hq, d)`` packed queries (f16, bf16 or float8_e4m3fn).
        k_cache, v_cache: ``(num_pages, page_size, Hkv, d)`` paged cache in q's dtype.
        out: ``(total_q, Hq, d)`` output, written in place (bf16 for FP8 inputs).
        batch: the batch metadata.
        index: kept blocks per tile; None for dense causal attention.
        plan: the correction plan (needs ``index``); None for none. A plan with a
            ``key_spread`` gets the second-order mass shift (C ABI 1.5; requests of up to
            2^20 tokens, 2^19 at d=256; refused on the opt-in persistent and serial schedules).
        lse: optional ``(total_q, Hq) float32`` log-sum-exp output.
        q_descale, k_descale, v_descale: ``(B, Hkv) float32``, required for FP8 inputs.
        softmax_scale: score scale; 0 selects ``1/sqrt(d)``.
        stream: CUDA stream; None uses q's current stream.
        workspace: optional device scratch memory (256-byte aligned) for split-KV and the work
            order; None asks the library how much the call can use (``fpv2_prefill_workspace_size``;
            0 unless it has too few query tiles to fill the GPU, or the opt-in work order
            ``FPV2_HOPPER_WORK_ORDER`` applies) and allocates it on ``stream``.
        pooled_e4m3: use the E4M3 pooled copies when a plan is given and the page size is a
            multiple of 128; None reads ``$FPV2_HOPPER_POOLED_E4M3`` ("1" on, anything else
            or unset off: off by default, measured no faster than the bf16 pooled products).

    Returns:
        ``out``.

    Raises:
        ImportError: the E4M3 copies were asked for but Triton is not installed.
        HopperKernelNotBuiltError: the kernel is not part of the loaded library.
        ValueError, UnsupportedConfigurationError: invalid or unsupported arguments.
        NativeError: a CUDA or internal failure.
        NativeLibraryError: the library is not available.
    """
    lib = load_native_library()
    copies = _pooled_e4m3_copies(plan, k_cache, pooled_e4m3, stream)
    args = prefill_args_struct(
        q,
        k_cache,
        v_cache,
        out,
        batch,
        index=index,
        plan=plan,
        lse=lse,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
        softmax_scale=softmax_scale,
        stream=stream,
        workspace=workspace,
        pooled_dtype=None if copies is not None else torch.bfloat16,
        pooled_e4m3=copies,
    )
    if workspace is None and _may_use_workspace(q, k_cache, args):
        # Split-KV (calls with too few query tiles to fill the GPU) needs scratch memory for its partial
        # rows, the work order (batches of uneven requests) for its tile permutation: ask the library how
        # much, allocated on the launch stream so that the caching allocator does not hand it out again
        # before the kernel is done with it.
        needed = ctypes.c_uint64(0)
        check_status(lib.fpv2_prefill_workspace_size(ctypes.byref(args), ctypes.byref(needed)))
        if needed.value:
            with _stream_context(stream, q):
                workspace = torch.empty(needed.value, dtype=torch.uint8, device=q.device)
            args.workspace = workspace.data_ptr()
            args.workspace_bytes = needed.value
    check_status(lib.fpv2_prefill(ctypes.byref(args)))
    return out


def _pooled_e4m3_copies(
    plan: CorrectionPlan | None, k_cache: torch.Tensor, pooled_e4m3: bool | None, stream: object
) -> PooledE4M3 | None:
    """The plan's E4M3 pooled copies when they are asked for and the pages take the TMA path, else None.

    The copies are made (and allocated) on the call's stream, so the prefill that reads them is
    ordered after the quantisation and their memory is reused only after the prefill.
    """
    if pooled_e4m3 is None:
        pooled_e4m3 = os.environ.get(POOLED_E4M3_ENV) == "1"
    if not pooled_e4m3 or not isinstance(plan, CorrectionPlan):
        return None
    page_size = k_cache.shape[1] if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4 else 0
    if page_size == 0 or page_size % HOPPER_KV_TILE:
        return None  # the gather path (pages not a multiple of 128) reads the bf16 pooled copies
    # Imported here: the binding itself needs no Triton, only this opt-in path does.
    from ..triton.pooled_e4m3 import quantize_pooled_e4m3

    stats = plan.statistics
    with _stream_context(stream, stats.pooled_k):
        return quantize_pooled_e4m3(stats.pooled_k, stats.pooled_v, stats.block_offsets)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _may_use_workspace(q: torch.Tensor, k_cache: torch.Tensor, args: object) -> bool:
    """Whether the library may want a workspace for the call: to split its KV blocks
    (csrc/hopper/split_kv.hpp: automatically only with fewer CTAs than SMs, or when
    ``FPV2_HOPPER_SPLITS`` forces splits), or to order its tiles by work (csrc/hopper/work_order.hpp,
    opt-in: ``FPV2_HOPPER_WORK_ORDER=1`` forces it, ``auto`` for more CTAs than SMs in a batch of
    uneven requests), or for the persistent CTAs' tile counter (``FPV2_HOPPER_PERSISTENT=dynamic``), or for
    the default schedule of a block-sparse call (csrc/hopper/schedule_default.hpp: the work order for a chunk
    after a cached prefix, with the tile queue for long requests).

    Saves the workspace query's host time on every other call; the library decides the rest.
    """
    if not q.is_cuda or q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape[2] == 0:
        return False
    batch = args.batch.contents  # type: ignore[attr-defined]
    return workspace_may_be_used(
        num_requests=int(batch.num_requests),
        total_q=int(batch.total_q),
        max_seqlen_q=int(batch.max_seqlen_q),
        max_seqlen_k=int(batch.max_seqlen_k),
        group=q.shape[1] // k_cache.shape[2],
        num_kv_heads=k_cache.shape[2],
        sms=_sm_count(q.device),
        splits=os.environ.get("FPV2_HOPPER_SPLITS", ""),
        work_order=os.environ.get("FPV2_HOPPER_WORK_ORDER", ""),
        persistent=os.environ.get("FPV2_HOPPER_PERSISTENT", ""),
    )


def workspace_may_be_used(
    *,
    num_requests: int,
    total_q: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    group: int,
    num_kv_heads: int,
    sms: int,
    splits: str = "",
    work_order: str = "",
    persistent: str = "",
) -> bool:
    """The binding's rule for asking the library for a workspace (host values only; the library decides).

    Args:
        num_requests, total_q, max_seqlen_q, max_seqlen_k: the batch's host-side sizes.
        group: ``Hq / Hkv``.
        num_kv_heads: ``Hkv``.
        sms: the device's SM count.
        splits: the ``FPV2_HOPPER_SPLITS`` setting ("" automatic).
        work_order: the ``FPV2_HOPPER_WORK_ORDER`` setting ("0" off, "1" forced, "auto"; "": the default
            schedule when ``persistent`` is "" too).
        persistent: the ``FPV2_HOPPER_PERSISTENT`` setting ("dynamic": the tile queue's counter; "": the
            default schedule when ``work_order`` is "" too).

    Returns:
        True when the call may split (fewer CTAs than SMs, or forced splits), may order its tiles by
        work (forced, ``auto`` over uneven requests with more CTAs than SMs, or by default with both
        settings unset: more CTAs than SMs after a cached prefix, or a request of at least
        :data:`DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES` CTAs, which also runs the tile queue) or may run
        persistent CTAs fed by the dynamic tile queue (forced).
    """
    if persistent == "dynamic":
        return True
    if splits not in ("", "1"):
        return True  # forced: the library needs the workspace (or says why the setting is wrong)
    if work_order == "1":
        return True
    request_ctas = -(-max_seqlen_q * group // 128) * num_kv_heads
    ctas = request_ctas * num_requests
    if persistent == "" and work_order == "":
        # The default schedule; the library decides from the rest (block-sparse, d = 128, the TMA path).
        if request_ctas >= DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES or (max_seqlen_k > max_seqlen_q and ctas > sms):
            return True
    if ctas < sms:
        return True
    uneven = num_requests > 1 and (total_q != num_requests * max_seqlen_q or max_seqlen_k > max_seqlen_q)
    return work_order == "auto" and uneven and ctas > sms


def _stream_context(stream: object, like: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Make ``stream`` (a ``torch.cuda.Stream``, a raw handle or None) torch's current stream on ``like``'s device."""
    device = like.device
    if stream is None or device.type != "cuda":
        return contextlib.nullcontext()
    if isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    handle = _stream_handle(stream, like)  # a TypeError for what the binding refuses
    if handle is None:  # handle 0: the legacy default stream
        return torch.cuda.stream(torch.cuda.default_stream(device))
    return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device))


#: The built head dims in ``fpv2_get_build_info()``: "head dims 64, 128" (or "head dim 128" before d=64).
_BUILT_HEAD_DIMS = re.compile(r"Hopper attention kernel: built \([^)]*?\bhead dims? (\d+(?:, \d+)*)")


def hopper_head_dims() -> tuple[int, ...]:
    """Head dims with a compiled instantiation of the Hopper kernel in the loaded library.

    Read from the library's build description (``fpv2_get_build_info()``), so tests
    and callers see what was built rather than a list of their own.

    Returns:
        The head dims, ascending; ``()`` when the library cannot be loaded or was
        built without the kernel.
    """
    ok, _ = native_status()
    if not ok:
        return ()
    lib = load_native_library()
    if not lib.fpv2_hopper_kernel_available():
        return ()
    found = _BUILT_HEAD_DIMS.search(lib.fpv2_get_build_info().decode())
    return tuple(sorted(int(d) for d in found.group(1).split(", "))) if found else ()


def hopper_available() -> tuple[bool, str]:
    """Whether :func:`hopper_prefill` can run here, and why not.

    Returns:
        ``(True, description)`` when the library has the kernel and an sm_90 GPU is
        visible, else ``(False, reason)``.
    """
    ok, reason = native_status()
    if not ok:
        return False, reason
    lib = load_native_library()
    if not lib.fpv2_hopper_kernel_available():
        return False, (
            "the Hopper attention kernel is not part of this build of libfpv2_kernel "
            f"({lib.fpv2_get_build_info().decode()}); use the reference or portable backend"
        )
    if not torch.cuda.is_available():
        return False, "no CUDA device is visible to torch"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return False, f"the Hopper kernel needs an sm_90 GPU; the current device is sm_{major}{minor}"
    return True, reason
