"""Attention backends: who runs the (block-sparse) attention stage of the pipeline.

A backend takes the prefill inputs, a block index and an optional correction
plan, and returns the attention output. ``resolve_backend("auto")`` picks the
available backend of highest priority; a backend the caller names explicitly
is used or refused with its reason, never silently replaced by another.

Registered here, in ``auto`` order: ``hopper`` (the native Hopper kernel
behind the C ABI), ``triton`` (the portable Triton kernel of ``fpv2.kernel``;
chosen by ``auto`` on CUDA GPUs, usable by name under the Triton interpreter)
and ``reference`` (the PyTorch reference of ``fpv2.kernel``; always available).
What ``auto`` passes over is logged once per process on the ``fpv2.serving``
logger: a warning where a Hopper GPU runs without the Hopper kernel (a missing
or CPU-only native library costs about half the speed), else at info level.

A backend may declare ``derives_todo = True``: it computes the correction's
todo bitmasks from the block index itself, so the pipeline hands it a plan
without materialised masks (no per-segment host work). ``mass_shifts`` lists the
correction plans' mass shifts it applies (``("mean",)`` when absent; see
:attr:`fpv2.kernel.CorrectionPlan.mass_shift`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from fpv2.kernel import BLOCK_SIZE, BlockIndex, CorrectionPlan, PagedPrefillBatch

from .fallback_backend import FallbackBackend
from .tile_repack_policy import should_carry_tile_pages, should_repack

if TYPE_CHECKING:
    from fpv2.kernel.triton.tile_repack import TileRepacked

#: Name that asks for the best available backend.
AUTO = "auto"


@runtime_checkable
class AttentionBackend(Protocol):
    """What the pipeline needs from an attention implementation."""

    name: str

    def available(self) -> tuple[bool, str]:
        """Whether the backend can run here, and why (or why not)."""
        ...

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        index: BlockIndex,
        plan: CorrectionPlan | None,
        *,
        softmax_scale: float | None,
        q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None,
        v_descale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Block-sparse attention of validated inputs.

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
            v_cache: paged values, same shape as ``k_cache``.
            batch: the batch metadata.
            index: kept blocks per (request, KV head, tile).
            plan: correction plan, or None for no correction.
            softmax_scale: logit scale (None: ``1/sqrt(d)``).
            q_descale: FP8 query descales ``(B, Hkv)`` or None.
            k_descale: FP8 key descales or None.
            v_descale: FP8 value descales or None.

        Returns:
            ``(total_q, Hq, d)`` output in :func:`output_dtype` of the inputs.
        """
        ...


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """Element type of the attention output for inputs of ``dtype`` (FP8 inputs give bf16).

    Args:
        dtype: the Q/K/V element type.

    Returns:
        The output element type.
    """
    return torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype


class ReferenceBackend:
    """The PyTorch reference of ``fpv2.kernel`` (fp32 math), on whatever device the inputs are."""

    name = "reference"
    #: The reference applies every plan's mass shift.
    mass_shifts = ("mean", "second_order")

    def available(self) -> tuple[bool, str]:
        """Always available.

        Returns:
            ``(True, description)``.
        """
        return True, "PyTorch reference (fpv2.kernel.reference), fp32 math on the inputs' device"

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        index: BlockIndex,
        plan: CorrectionPlan | None,
        *,
        softmax_scale: float | None,
        q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None,
        v_descale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run :func:`fpv2.kernel.reference.sparse.sparse_attention` and cast to the output dtype.

        Arguments as for :meth:`AttentionBackend.run`.

        Returns:
            ``(total_q, Hq, d)`` output in :func:`output_dtype` of the inputs.
        """
        from fpv2.kernel.reference.sparse import sparse_attention

        out = sparse_attention(
            q,
            k_cache,
            v_cache,
            batch,
            index,
            plan=plan,
            softmax_scale=softmax_scale,
            compute_dtype=torch.float32,
            q_descale=q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
        )
        return out.to(output_dtype(q.dtype))


class TritonBackend:
    """The portable Triton kernel (:func:`fpv2.kernel.triton.sparse_attention_triton`)."""

    name = "triton"
    #: The kernel derives the todo bitmasks from the CSR in the kernel.
    derives_todo = True
    #: The kernel applies the second-order mass shift of plans with a key spread.
    mass_shifts = ("mean", "second_order")

    def available(self) -> tuple[bool, str]:
        """Available with Triton and either a CUDA GPU or ``TRITON_INTERPRET=1``.

        Returns:
            ``(ok, reason)``.
        """
        try:
            import triton
        except ImportError as exc:
            return False, f"triton is not installed ({exc})"
        if torch.cuda.is_available():
            return True, f"Triton {triton.__version__} on {torch.cuda.get_device_name()}"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True, f"Triton {triton.__version__} interpreter on the CPU (slow: for tests)"
        return False, "no CUDA GPU (and TRITON_INTERPRET is not set)"

    def auto_eligible(self) -> bool:
        """``auto`` picks this backend on CUDA GPUs only, never the interpreter.

        Returns:
            Whether a CUDA GPU is present.
        """
        return torch.cuda.is_available()

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        index: BlockIndex,
        plan: CorrectionPlan | None,
        *,
        softmax_scale: float | None,
        q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None,
        v_descale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run the Triton kernel.

        Arguments as for :meth:`AttentionBackend.run`.

        Returns:
            ``(total_q, Hq, d)`` output in :func:`output_dtype` of the inputs.
        """
        from fpv2.kernel.triton import sparse_attention_triton

        return sparse_attention_triton(
            q,
            k_cache,
            v_cache,
            batch,
            index,
            plan=plan,
            softmax_scale=softmax_scale,
            q_descale=q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
        )

    def run_dense(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        *,
        softmax_scale: float | None,
        q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None,
        v_descale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The kernel's dense mode: every causally visible block, no block index to build.

        Arguments as for :meth:`AttentionBackend.run`, without index and plan.

        Returns:
            ``(total_q, Hq, d)`` output in :func:`output_dtype` of the inputs.
        """
        from fpv2.kernel.triton import sparse_attention_triton

        return sparse_attention_triton(
            q,
            k_cache,
            v_cache,
            batch,
            None,
            softmax_scale=softmax_scale,
            q_descale=q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
        )


class HopperBackend:
    """The native Hopper (sm_90a) kernel, loaded through the C ABI of ``fpv2.kernel._native``."""

    name = "hopper"
    #: The kernel marks the kept blocks of each tile itself; it needs no todo bitmasks.
    derives_todo = True
    #: Both shifts: the C ABI's plan carries the key spread since ABI 1.5 (the kernel then serves requests of up
    #: to 2^20 tokens, 2^19 at d = 256, and refuses longer ones by name).
    mass_shifts = ("mean", "second_order")
    #: Page-size multiple and block size of the kernel's TMA path (its KV tile is the contracts' key block).
    kv_tile = BLOCK_SIZE
    #: The loaded library's built head dims, read on the first ``serves`` (None until then).
    _head_dims: tuple[int, ...] | None = None
    #: How the last call's K/V reached the kernel: ``"paged"`` (the caller's cache) or ``"tile-repack"``
    #: (copied into 128-token pages first); None before the first call.
    last_kv_layout: str | None = None
    #: Whether the last call's tile-page copy came from the pooling kernel (``tile_copies``) rather than a copy
    #: launch of its own; None before the first call.
    last_copy_pooled: bool | None = None

    def serves(
        self, q: torch.Tensor, k_cache: torch.Tensor, batch: PagedPrefillBatch, index: BlockIndex | None
    ) -> str | None:
        """Host-side check of the calls ``auto`` sends to the kernel (others go to the fallback backend).

        Every page size is served: TMA for multiples of the 128-token tile,
        the cp.async gather otherwise (page size 1 included), which measured
        faster than the Triton kernel on the H200 (128K pipeline 16.5 against
        24.1 ms, 2026-12-03, see ``benchmarks/NOTES.md``), or the tile repack
        in front of the TMA path where :func:`should_repack` says so. Caches the
        kernel cannot read as one ``(num_pages * page_size, Hkv * d)`` row-major
        matrix (vLLM's K/V views, the head-major K/V of a transformers layer)
        are served when the tile repack copies them (small pages, unit element
        stride) and go to the fallback otherwise. The library refuses what it
        cannot run at all (dtype, head dim).

        Args:
            q: the queries.
            k_cache: the paged keys.
            batch: the batch metadata.
            index: the block index, or None for dense attention.

        Returns:
            None when the kernel serves the call, else why not.
        """
        if not q.is_cuda:
            return "the inputs are not on a CUDA device"
        if q.dtype != torch.bfloat16:
            return f"the Hopper kernel takes bf16 inputs; got {q.dtype}"
        built = self._built_head_dims()
        if q.shape[-1] not in built:
            # Every built head dim measured faster than the Triton kernel on the H200 (d = 64 at 32K, page
            # 128: dense 9.65 against 13.11 ms, sparse + correction 1.97 against 2.87 ms attention).
            return (
                f"the loaded Hopper kernel is built for head dims {', '.join(map(str, built)) or 'none'}; "
                f"got {q.shape[-1]}"
            )
        layout = self._cache_layout_problem(k_cache)
        if layout is not None and not self._copy_reads(k_cache, batch):
            return layout
        if index is not None and index.block_size != self.kv_tile:
            return f"the Hopper kernel visits 128-token blocks; got index.block_size={index.block_size}"
        return None

    def _built_head_dims(self) -> tuple[int, ...]:
        """The library's built head dims, read once per backend (``serves`` runs on every call)."""
        built = self._head_dims
        if built is None:
            from fpv2.kernel._native import hopper_head_dims

            built = self._head_dims = hopper_head_dims()
        return built

    def _copy_reads(self, k_cache: torch.Tensor, batch: PagedPrefillBatch) -> bool:
        """Whether the tile repack will carry a cache the kernel cannot read as it is (for example vLLM's K/V views).

        The copy reads any page, token and head strides with unit element stride; it is made when
        :func:`should_repack` says so for a cache the kernel cannot read (pages of any size).
        """
        if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4 or k_cache.stride(3) != 1:
            return False
        try:
            return should_repack(batch, self.kv_tile, k_cache=k_cache, kernel_reads_pages=False)
        except ImportError:  # FPV2_HOPPER_REPACK=1 without Triton: the call goes to the fallback
            return False

    def _copies(self, k_cache: torch.Tensor, batch: PagedPrefillBatch) -> bool:
        """Whether a call's K/V go through the tile repack: the kernel cannot read them, or the policy says so."""
        # ``serves`` took a cache only the copy reads after asking the policy: copy it without asking again (the
        # memory check might also have changed its mind since).
        return self._cache_layout_problem(k_cache) is not None or should_repack(batch, self.kv_tile, k_cache=k_cache)

    def tile_copies_for(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch
    ) -> TileRepacked | None:
        """Empty tile pages for this call's K/V when it will run on the copy, for the pooling kernel to fill.

        The pipeline asks before pooling: the pooling kernel reads every token of the caches anyway, so it
        writes the copy (:func:`fpv2.index.triton.pool_blocks_triton` with ``tile_copies``) and :meth:`run`
        takes it (``tile_copies=``) instead of copying again: one read of the batch's K/V and one launch less.

        Returns:
            :func:`~fpv2.kernel.triton.tile_repack.allocate_tile_pages` for the call, or None when this backend
            does not serve it or reads the caches as they are.
        """
        # The copy rule first: it declines a tile-sized cache at once, before the longer serves() checks.
        if not self._copies(k_cache, batch) or self.serves(q, k_cache, batch, None) is not None:
            return None
        from fpv2.kernel.triton.tile_repack import allocate_tile_pages

        return allocate_tile_pages(k_cache, v_cache, batch)

    def carries_tile_pages(
        self, q: torch.Tensor, k_cache: torch.Tensor, batch: PagedPrefillBatch, copy_bytes: int
    ) -> bool:
        """Whether a chunked prefill should keep its request's K/V in tile pages for this backend's calls.

        Asked by :mod:`fpv2.serving.chunked_tile_pages` before its first copy: the kernel serves the call,
        reads the cache as it is, and its pages are not tile pages
        (:func:`~fpv2.serving.tile_repack_policy.should_carry_tile_pages`, ``copy_bytes`` the whole
        prompt's copies). :meth:`run` then takes the carried copy as ``tile_copies``.

        Returns:
            True when the copy pays and fits.
        """
        if self._cache_layout_problem(k_cache) is not None or self.serves(q, k_cache, batch, None) is not None:
            return False
        return should_carry_tile_pages(batch.page_size, self.kv_tile, copy_bytes, k_cache.device)

    @staticmethod
    def _cache_layout_problem(cache: torch.Tensor) -> str | None:
        """Why the kernel cannot view ``cache`` as a ``(num_pages * page_size, Hkv * d)`` row matrix, or None."""
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            return None  # the contract check names the shape error
        _, page_size, num_kv_heads, head_dim = cache.shape
        page_stride, token_stride, head_stride, elem_stride = cache.stride()
        if elem_stride != 1 or head_stride != head_dim or token_stride < num_kv_heads * head_dim:
            return (
                "the Hopper kernel reads the cache as (num_pages * page_size, Hkv * d) rows: it needs head stride d "
                f"and token stride >= Hkv * d; got strides {tuple(cache.stride())} for shape {tuple(cache.shape)}"
            )
        if page_size > 1 and page_stride != page_size * token_stride:
            return (
                f"the Hopper kernel needs contiguous pages (page stride = page_size * token stride = "
                f"{page_size * token_stride}); got page stride {page_stride}"
            )
        return None

    def available(self) -> tuple[bool, str]:
        """Ask the native loader whether the Hopper kernel can run here.

        Returns:
            ``(ok, reason)`` from ``fpv2.kernel._native.hopper_available()``, or
            ``(False, why the loader module is missing)``.
        """
        try:
            from fpv2.kernel import _native
        except ImportError as exc:
            return False, f"fpv2.kernel._native cannot be imported ({exc})"
        probe = getattr(_native, "hopper_available", None)
        if probe is None:
            return False, "fpv2.kernel._native provides no hopper_available() (incomplete kernel install?)"
        try:
            ok, reason = probe()
        except Exception as exc:  # a broken loader must not take the registry down with it
            return False, f"hopper_available() failed: {type(exc).__name__}: {exc}"
        return bool(ok), str(reason)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        index: BlockIndex | None,
        plan: CorrectionPlan | None,
        *,
        softmax_scale: float | None,
        q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None,
        v_descale: torch.Tensor | None,
        tile_copies: TileRepacked | None = None,
    ) -> torch.Tensor:
        """Run ``fpv2.kernel._native.hopper_prefill`` into a fresh output tensor.

        Arguments as for :meth:`AttentionBackend.run`; ``index=None`` (with no plan) is
        dense causal attention. Pages that are not a multiple of the 128-token tile are
        first copied into tile pages when :func:`~fpv2.serving.tile_repack_policy.should_repack`
        says so (the kernel then runs its TMA path; ``FPV2_HOPPER_REPACK`` overrides), and
        always for caches the kernel cannot read as they are (``serves`` took them for the copy).
        ``tile_copies``: that copy, already made (:meth:`tile_copies_for`, filled by the pooling kernel).

        Returns:
            ``(total_q, Hq, d)`` output.
        """
        from fpv2.kernel._native import hopper_prefill

        self.last_copy_pooled = tile_copies is not None
        if tile_copies is not None:
            k_cache, v_cache, batch = tile_copies.k_cache, tile_copies.v_cache, tile_copies.batch
            self.last_kv_layout = "tile-repack"
        elif self._copies(k_cache, batch):
            # Small pages: one copy of the call's KV into tile pages, then the TMA path (tile_repack_policy).
            from fpv2.kernel.triton.tile_repack import repack_to_tile_pages

            packed = repack_to_tile_pages(k_cache, v_cache, batch)
            k_cache, v_cache, batch = packed.k_cache, packed.v_cache, packed.batch
            self.last_kv_layout = "tile-repack"
        else:
            self.last_kv_layout = "paged"
        out = torch.empty(q.shape, dtype=output_dtype(q.dtype), device=q.device)
        return hopper_prefill(
            q,
            k_cache,
            v_cache,
            out,
            batch,
            index=index,
            plan=plan,
            q_descale=q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
            softmax_scale=0.0 if softmax_scale is None else float(softmax_scale),  # 0 selects 1/sqrt(d)
        )

    def run_dense(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        *,
        softmax_scale: float | None,
        q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None,
        v_descale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Dense causal attention with the kernel (no block index).

        Arguments as for :meth:`AttentionBackend.run`, without index and plan.

        Returns:
            ``(total_q, Hq, d)`` output.
        """
        return self.run(
            q,
            k_cache,
            v_cache,
            batch,
            None,
            None,
            softmax_scale=softmax_scale,
            q_descale=q_descale,
            k_descale=k_descale,
            v_descale=v_descale,
        )


# name -> (priority, backend); "auto" tries lower priorities first.
_REGISTRY: dict[str, tuple[int, AttentionBackend]] = {}


def register_backend(backend: AttentionBackend, *, priority: int) -> None:
    """Add (or replace) a backend; ``auto`` tries backends in ascending ``priority``.

    Args:
        backend: an object satisfying :class:`AttentionBackend`.
        priority: rank for ``auto`` (lower is tried first).

    Raises:
        TypeError: ``backend`` does not satisfy the protocol.
        ValueError: its name is empty or ``"auto"``.
    """
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"backend must provide name, available() and run(); got {type(backend).__name__}")
    if not backend.name or backend.name == AUTO:
        raise ValueError(f"backend name must be a non-empty string other than {AUTO!r}; got {backend.name!r}")
    _REGISTRY[backend.name] = (priority, backend)


def registered_backends() -> list[str]:
    """Names of all registered backends, in ``auto`` order (available or not).

    Returns:
        The backend names.
    """
    return [name for name, _ in sorted(_REGISTRY.items(), key=lambda item: item[1][0])]


def backend_status() -> dict[str, tuple[bool, str]]:
    """Availability and reason of every registered backend, in ``auto`` order.

    Returns:
        ``{name: (available, reason)}``.
    """
    return {name: _REGISTRY[name][1].available() for name in registered_backends()}


def available_backends() -> list[str]:
    """Names of the backends that can run here, in ``auto`` order.

    Returns:
        The available backend names (``reference`` is always among them).
    """
    return [name for name, (ok, _) in backend_status().items() if ok]


def _with_fallback(backend: AttentionBackend, name: str) -> AttentionBackend:
    """For ``auto``: a backend that serves only some calls (``serves``) gets the next available one behind it."""
    if not callable(getattr(backend, "serves", None)):
        return backend
    later = registered_backends()
    for candidate in later[later.index(name) + 1 :]:
        fallback = _REGISTRY[candidate][1]
        if getattr(fallback, "auto_eligible", lambda: True)() and fallback.available()[0]:
            return FallbackBackend(backend, fallback)
    return backend


_LOG = logging.getLogger("fpv2.serving")
#: (chosen, passed-over reasons) already logged by :func:`_report_auto_choice`.
_REPORTED_AUTO_CHOICES: set[tuple[str, tuple[str, ...]]] = set()


def _report_auto_choice(chosen: str, passed_over: list[str]) -> None:
    """Log, once per process and outcome, which backends ``auto`` passed over and why.

    A warning where the device is a Hopper GPU and ``hopper`` was passed over (the
    product's fast path is missing where it should run), else info.
    """
    key = (chosen, tuple(passed_over))
    if not passed_over or key in _REPORTED_AUTO_CHOICES:
        return
    _REPORTED_AUTO_CHOICES.add(key)
    hopper_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    hopper_missing = any(reason.startswith("hopper:") for reason in passed_over)
    level = logging.WARNING if hopper_gpu and hopper_missing else logging.INFO
    _LOG.log(level, "attention backend 'auto' chose %r; passed over: %s", chosen, "; ".join(passed_over))


def resolve_backend(name: str | AttentionBackend = AUTO) -> AttentionBackend:
    """The backend to use for ``name``.

    Args:
        name: ``"auto"`` (first available in priority order; a backend that
            serves only some calls, like ``hopper``, comes wrapped in a
            :class:`~fpv2.serving.fallback_backend.FallbackBackend` with the next
            available one), a registered name, or a backend object (checked for
            availability).

    Returns:
        The backend.

    Raises:
        TypeError: ``name`` is neither a string nor a backend.
        ValueError: ``name`` is not registered (the message lists the names).
        RuntimeError: the named backend is not available here (with its reason);
            there is no silent fallback to another backend.

    ``auto`` logs what it passed over (see the module's docstring).
    """
    if isinstance(name, str):
        if name == AUTO:
            reasons = []
            for candidate in registered_backends():
                backend = _REGISTRY[candidate][1]
                if not getattr(backend, "auto_eligible", lambda: True)():
                    reasons.append(f"{candidate}: not chosen automatically here")
                    continue
                ok, why = backend.available()
                if ok:
                    _report_auto_choice(candidate, reasons)
                    return _with_fallback(backend, candidate)
                reasons.append(f"{candidate}: {why}")
            raise RuntimeError("no attention backend is available: " + "; ".join(reasons))
        if name not in _REGISTRY:
            names = ", ".join([AUTO, *registered_backends()])
            raise ValueError(f"unknown attention backend {name!r}; choose one of: {names}")
        backend = _REGISTRY[name][1]
    elif isinstance(name, AttentionBackend):
        backend = name
    else:
        raise TypeError(f"backend must be a name or an AttentionBackend; got {type(name).__name__}")
    ok, why = backend.available()
    if not ok:
        raise RuntimeError(f"attention backend {backend.name!r} is not available: {why}")
    return backend


register_backend(HopperBackend(), priority=0)
register_backend(TritonBackend(), priority=50)
register_backend(ReferenceBackend(), priority=100)
