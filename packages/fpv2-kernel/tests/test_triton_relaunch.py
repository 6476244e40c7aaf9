"""Cheaper relaunches of compiled Triton kernels (:class:`fpv2.kernel.triton.relaunch.Relauncher`).

A fake ``JITFunction`` records the normal launches and a fake compiled kernel the direct ones, so these run on
any machine: a relaunch happens only under the key Triton itself would reuse a compiled kernel for (argument
specialisation, constexprs, launch options), calls the C launch of a CUDA launcher directly, and falls back to
the normal launch with hooks installed, ``FPV2_TRITON_RELAUNCH=0`` or other call shapes.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from fpv2.kernel.triton import relaunch as launcher  # noqa: E402


def _py_kernel(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


class _Compiled:
    """Stands in for a CompiledKernel: records direct runs."""

    function = 1234
    packed_metadata = ("meta",)

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def run(self, *args: object) -> None:
        self.runs.append(args)


class _FakeJIT(triton.runtime.jit.JITFunction):
    """A real JITFunction's parameter model whose normal launch is recorded instead of compiled."""

    def __init__(self) -> None:
        super().__init__(_py_kernel)
        self.normal_calls: list[tuple] = []
        self.compiled: list[_Compiled] = []

    def run(self, *args: object, grid: object, warmup: bool, **kwargs: object) -> _Compiled:
        self.normal_calls.append((grid, args, kwargs))
        self.compiled.append(_Compiled())
        return self.compiled[-1]


def _fake_relauncher(monkeypatch: pytest.MonkeyPatch) -> tuple[launcher.Relauncher, _FakeJIT]:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    monkeypatch.setattr(launcher, "interpreter_enabled", lambda: False)
    monkeypatch.delenv(launcher.RELAUNCH_ENV, raising=False)
    fn = _FakeJIT()
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    relaunch = launcher.Relauncher(fn, device=lambda: 0, stream=lambda device: 777, backend=lambda f, d: backend)
    return relaunch, fn


def test_relauncher_relaunches_only_under_tritons_own_specialisation_key(monkeypatch: pytest.MonkeyPatch) -> None:
    relaunch, fn = _fake_relauncher(monkeypatch)
    x = torch.empty(64)
    y = torch.empty(64, dtype=torch.float16)
    relaunch((3,), x, y, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # first call: normal launch, kept
    relaunch((5, 2), x, y, 48, 0.25, BLOCK=16, FLAG=True, num_warps=4)  # 48 like 32: divisible by 16
    assert len(fn.normal_calls) == 1 and relaunch.direct == 1
    run = fn.compiled[0].runs[0]
    # grid, stream, function, metadata, no launch metadata or hooks, then runtime args and constexprs in order.
    assert run == (5, 2, 1, 777, 1234, ("meta",), None, None, None, x, y, 48, 0.25, 16, True)
    # Anything Triton specialises on is a new key: a normal launch (which Triton may compile).
    relaunch((3,), x[1:], y, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # pointer not 16-byte aligned
    relaunch((3,), x, y.float(), 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # pointer dtype
    relaunch((3,), x, y, 1, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # an int equal to 1
    relaunch((3,), x, y, 33, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # not divisible by 16
    relaunch((3,), x, y, 2**33, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # i64
    relaunch((3,), x, y, 32, 0.5, BLOCK=32, FLAG=True, num_warps=4)  # a constexpr
    relaunch((3,), x, y, 32, 0.5, BLOCK=16, FLAG=True, num_warps=8)  # a launch option
    assert len(fn.normal_calls) == 8 and relaunch.direct == 1
    relaunch((3,), x, y, 17, 0.75, BLOCK=16, FLAG=True, num_warps=4)  # 17 like 33; floats are not specialised
    assert len(fn.normal_calls) == 8 and relaunch.direct == 2


class CudaLauncher:
    """Named like Triton's launcher: the relaunch calls its C ``launch`` straight, skipping ``__call__``."""

    global_scratch_size = 0
    profile_scratch_size = 0
    num_ctas = 1
    launch_cooperative_grid = False
    launch_pdl = True

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def launch(self, *args: object) -> None:
        self.launches.append(args)

    def __call__(self, *args: object) -> None:
        raise AssertionError("the relaunch goes to launch(), not __call__")


def test_relauncher_calls_the_c_launch_of_a_cuda_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    relaunch, fn = _fake_relauncher(monkeypatch)
    cuda_launcher = CudaLauncher()
    original = fn.run

    def run_with_launcher(*args: object, grid: object, warmup: bool, **kwargs: object) -> _Compiled:
        compiled = original(*args, grid=grid, warmup=warmup, **kwargs)
        compiled.run = cuda_launcher  # what CompiledKernel.run is on CUDA
        return compiled

    fn.run = run_with_launcher
    x = torch.empty(64)
    relaunch((2,), x, x, 32, 0.5, BLOCK=16, FLAG=False)  # normal launch, kept
    relaunch((4, 3, 2), x, x, 32, 0.5, BLOCK=16, FLAG=False)
    assert len(fn.normal_calls) == 1
    assert cuda_launcher.launches == [
        (4, 3, 2, 777, 1234, False, True, None, None, ("meta",), None, None, None, x, x, 32, 0.5, 16, False)
    ]


def test_relauncher_falls_back_with_hooks_env_or_other_call_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    relaunch, fn = _fake_relauncher(monkeypatch)
    x = torch.empty(64)
    args = (x, x, 32, 0.5)
    relaunch((1,), *args, BLOCK=16, FLAG=False)
    relaunch((1,), *args, BLOCK=16, FLAG=False)
    assert relaunch.direct == 1
    hook_chain = triton.knobs.runtime.launch_enter_hook

    def hook(metadata: object) -> None:
        pass

    hook_chain.add(hook)
    try:
        relaunch((1,), *args, BLOCK=16, FLAG=False)  # a profiler's hook wants JITFunction.run's metadata
    finally:
        hook_chain.remove(hook)
    monkeypatch.setenv(launcher.RELAUNCH_ENV, "0")
    relaunch((1,), *args, BLOCK=16, FLAG=False)
    monkeypatch.delenv(launcher.RELAUNCH_ENV)
    relaunch((1,), x, x, 32, 0.5, 16, FLAG=False)  # a constexpr passed positionally: not the modelled shape
    relaunch(lambda meta: (1,), *args, BLOCK=16, FLAG=False)  # a callable grid
    assert relaunch.direct == 1 and len(fn.normal_calls) == 5
    relaunch((1,), *args, BLOCK=16, FLAG=False)
    assert relaunch.direct == 2
