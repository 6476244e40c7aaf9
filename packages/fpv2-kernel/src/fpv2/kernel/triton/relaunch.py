"""Cheaper relaunches of compiled Triton kernels: skip ``JITFunction.run`` once a kernel is compiled.

Every ``kernel[grid](*args, **meta)`` call goes through Triton's
``JITFunction.run`` (Triton 3.6: ``triton/runtime/jit.py``), which on each call
rebinds every argument through a generated binder, rebuilds the cache key
string (``str(options)`` included), looks the compiled kernel up, checks the
kernel's globals, builds a launch-metadata dict and finally calls
``CompiledKernel.run(grid_0, grid_1, grid_2, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *all_args)`` (the
generated C launcher; constexpr values are passed and ignored there). That
bookkeeping costs more host time than the launch itself for kernels with
many arguments.

:class:`Relauncher` keeps the :class:`~triton.compiler.CompiledKernel` that a
first, normal launch returns, keyed by what Triton's own specialisation
depends on, and calls its ``run`` directly on later calls with the same key:

- each runtime argument through Triton's ``native_specialize_impl`` (the
  function the binder calls: pointer dtype and 16-byte alignment, an int
  equal to 1, divisibility by 16 and width i32/i64/u64), with the
  parameter's own ``do_not_specialize`` flags;
- the constexpr values and launch options (``num_warps``, ``num_stages``,
  ``maxnreg``, ...), and Triton's ``debug`` and instrumentation knobs;
- the current CUDA device (a compiled kernel's function handle belongs to one).

So a relaunch runs exactly the binary ``JITFunction.run`` would pick. The
normal launch is used instead (and the helper is a plain ``fn[grid](...)``):
under the interpreter (``TRITON_INTERPRET=1``), on the first call for a key,
while Triton launch hooks or pre-run hooks are installed (profilers), for
async-compile futures, for grids given as callables, when the installed
Triton lacks the entry points used here, or with ``FPV2_TRITON_RELAUNCH=0``.
Unlike ``JITFunction.run`` a relaunch does not re-check the kernel's global
variables: the fpv2 kernels launched through it (the index stage's, the tile
repack) read none that change. It lives in the kernel wheel, which every other
fpv2 wheel depends on, so each of them can launch through it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

#: Environment switch: ``0`` sends every launch through ``JITFunction.run``.
RELAUNCH_ENV = "FPV2_TRITON_RELAUNCH"

try:  # the pieces of Triton's launch path used by the direct relaunch (Triton 3.6)
    from triton import knobs as _knobs
    from triton._C.libtriton import native_specialize_impl as _specialize
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # another Triton layout: always launch normally
    _knobs = None
    _specialize = None
    _JITFunction = None


def interpreter_enabled() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``).

    Returns:
        True when the environment variable is set to a true value.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def relaunch_enabled() -> bool:
    """Whether direct relaunches are allowed at all (``FPV2_TRITON_RELAUNCH`` unset or true).

    Returns:
        False when the environment turns them off.
    """
    return os.environ.get(RELAUNCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _hooks_installed() -> bool:
    """Launch hooks (e.g. a profiler's) want ``JITFunction.run``'s launch metadata: keep the normal path."""
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        calls = getattr(hook, "calls", hook)  # a HookChain in 3.6, a callable or None before
        if calls:
            return True
    return False


def _cuda_device() -> int:
    import torch

    return torch.cuda.current_device()


def raw_cuda_stream(device: int) -> int:
    """The raw handle of ``device``'s current CUDA stream, as the launches read it (no Stream object built).

    Args:
        device: a CUDA device index.

    Returns:
        The ``cudaStream_t`` value.
    """
    import torch

    return torch._C._cuda_getCurrentRawStream(device)


def _cuda_backend(fn: Any, device: int) -> Any:
    """The Triton backend object ``fn``'s binder specialises with on ``device``."""
    return fn.device_caches[device][3]


class Relauncher:
    """Launch one ``@triton.jit`` kernel, relaunching its compiled kernel directly when Triton would reuse it.

    Call it as ``launcher(grid, *runtime_args, **constexprs_and_options)``: the
    runtime (non-constexpr) parameters positionally, in order, the constexpr
    parameters and launch options by keyword, as ``kernel[grid](...)`` takes them.
    Other call shapes are passed to ``kernel[grid]`` unchanged.

    Args:
        fn: the kernel (a ``JITFunction``; under the interpreter an ``InterpretedFunction``, always
            launched normally).
        device: returns the current CUDA device index (injectable for tests).
        stream: returns the raw current stream of a device (injectable for tests).
        backend: returns the Triton backend of ``fn`` on a device (injectable for tests).

    Attributes:
        direct: direct relaunches so far.
        normal: launches through ``kernel[grid]`` so far.
    """

    def __init__(
        self,
        fn: Any,
        *,
        device: Callable[[], int] = _cuda_device,
        stream: Callable[[int], int] = raw_cuda_stream,
        backend: Callable[[Any, int], Any] = _cuda_backend,
    ) -> None:
        self.fn = fn
        self._device = device
        self._stream = stream
        self._backend = backend
        self._kernels: dict[tuple, Any] = {}
        self._backends: dict[int, Any] = {}
        self.direct = 0
        self.normal = 0
        params = getattr(fn, "params", None)
        self._eligible = _specialize is not None and params is not None and not interpreter_enabled()
        if self._eligible:
            runtime = [p for p in params if not p.is_constexpr]
            self._constexpr_names = tuple(p.name for p in params if p.is_constexpr)
            # The relaunch passes runtime args then constexpr values: only kernels declared in that order qualify.
            # Annotated parameters are specialised differently by the binder: not modelled here.
            self._eligible = all(not p.is_constexpr for p in params[: len(runtime)]) and not any(
                p.annotation_type for p in runtime
            )
            self._num_runtime = len(runtime)
            self._is_const = [p.is_const for p in runtime]
            self._specialize_flags = [not p.do_not_specialize for p in runtime]
            self._align_flags = [not p.do_not_specialize_on_alignment for p in runtime]

    def key(self, device: int, args: Sequence[Any], meta: dict[str, Any]) -> tuple:
        """The cache key of a launch: Triton's specialisation of each runtime argument, constexprs, options.

        Args:
            device: current CUDA device index.
            args: the runtime arguments, in parameter order.
            meta: constexpr values and launch options.

        Returns:
            A hashable key; equal keys select the same compiled kernel in ``JITFunction.run``.
        """
        backend = self._backends.get(device)
        if backend is None:
            backend = self._backends[device] = self._backend(self.fn, device)
        n = len(args)
        spec = tuple(map(_specialize, [backend] * n, args, self._is_const, self._specialize_flags, self._align_flags))
        runtime = _knobs.runtime
        return (device, spec, tuple(meta.items()), runtime.debug, _knobs.compilation.instrumentation_mode)

    def __call__(self, grid: Sequence[int], *args: Any, **meta: Any) -> None:
        """Launch ``fn`` on ``grid`` (the current stream), directly when its compiled kernel is known.

        Args:
            grid: one to three program counts.
            *args: runtime arguments, in parameter order.
            **meta: constexpr values and launch options.
        """
        if (
            not self._eligible
            or len(args) != self._num_runtime
            or callable(grid)
            or self.fn.pre_run_hooks
            or _hooks_installed()
            or not relaunch_enabled()
        ):
            self.normal += 1
            self.fn[grid](*args, **meta)
            return
        device = self._device()
        key = self.key(device, args, meta)
        entry = self._kernels.get(key)
        if entry is None:
            self.normal += 1
            kernel = self.fn[grid](*args, **meta)
            # A future (async compile) or a kernel without a loaded function is not relaunched.
            if kernel is not None and not hasattr(kernel, "result") and getattr(kernel, "function", None) is not None:
                try:
                    tail = tuple([meta[name] for name in self._constexpr_names])
                except KeyError:  # a constexpr left to its default: Triton binds it, every time
                    return
                self._kernels[key] = (*_direct_call(kernel), tail)
            return
        launch, head, tail = entry
        size = len(grid)
        self.direct += 1
        launch(
            grid[0],
            grid[1] if size > 1 else 1,
            grid[2] if size > 2 else 1,
            self._stream(device),
            *head,
            *args,
            *tail,
        )


def _direct_call(kernel: Any) -> tuple[Callable[..., Any], tuple]:
    """``(launch, head)``: ``launch(grid_0, grid_1, grid_2, stream, *head, *args)`` runs ``kernel``.

    ``CompiledKernel.run`` is Triton's ``CudaLauncher``, whose ``__call__`` only allocates the
    global and profile scratch (none for these kernels) before calling its C ``launch``; for such
    a launcher the C function is called directly. Launch metadata and hooks are None: only
    launch hooks read them, and the relaunch runs only while none are installed.
    """
    run = kernel.run
    launch = getattr(run, "launch", None)
    if (
        launch is not None
        and type(run).__name__ == "CudaLauncher"
        and getattr(run, "global_scratch_size", 1) == 0
        and getattr(run, "profile_scratch_size", 1) == 0
        and getattr(run, "num_ctas", 1) == 1
    ):
        head = (
            kernel.function,
            run.launch_cooperative_grid,
            run.launch_pdl,
            None,  # global scratch
            None,  # profile scratch
            kernel.packed_metadata,
            None,  # launch metadata
            None,  # enter hook
            None,  # exit hook
        )
        return launch, head
    return run, (kernel.function, kernel.packed_metadata, None, None, None)
