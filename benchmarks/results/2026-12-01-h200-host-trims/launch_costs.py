"""Host cost of the pieces of a pipeline call's Triton launches and of a few torch calls (device micro-benchmark)."""

import time

import torch

from fpv2.index import SelectionConfig
from fpv2.index.triton import launcher
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline

wl = planted_workload(
    [32768],
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=128,
    dtype=torch.bfloat16,
    device=torch.device("cuda"),
    seed=0,
)
pipe = SparsePrefillPipeline(SelectionConfig(alpha=0.1), correction=True, backend="auto")
for _ in range(3):
    pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
torch.cuda.synchronize()
calls = {}
original = launcher.Relauncher.__call__


def recording(self, grid, *args, **meta):
    calls[self.fn.__name__] = (self, grid, args, meta)
    return original(self, grid, *args, **meta)


launcher.Relauncher.__call__ = recording
pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
torch.cuda.synchronize()
launcher.Relauncher.__call__ = original


def timed(name, fn, n=300):
    fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    xs.sort()
    print(f"{name:50s} median {xs[len(xs) // 2]:7.1f} us  p10 {xs[len(xs) // 10]:7.1f}")


device = torch.cuda.current_device()
for name, (relauncher, grid, args, meta) in calls.items():
    print(f"{name}: {len(args)} runtime args, direct={relauncher.direct} normal={relauncher.normal}")
    timed(f"  {name} whole launch", lambda: relauncher(grid, *args, **meta))  # noqa: B023
    timed(f"  {name} key()", lambda: relauncher.key(device, args, meta))  # noqa: B023
    launch, head, tail = relauncher._kernels[relauncher.key(device, args, meta)]
    stream = torch._C._cuda_getCurrentRawStream(device)
    g = tuple(grid) + (1,) * (3 - len(grid))
    timed(f"  {name} C launch only", lambda: launch(g[0], g[1], g[2], stream, *head, *args, *tail))  # noqa: B023
    timed(
        f"  {name} fn.pre_run_hooks/_hooks_installed/relaunch_enabled",
        lambda: (relauncher.fn.pre_run_hooks, launcher._hooks_installed(), launcher.relaunch_enabled()),  # noqa: B023
    )
timed("torch.cuda.current_device()", torch.cuda.current_device)
timed("torch.cuda.current_stream()", torch.cuda.current_stream)
timed("_cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(0))
timed("Event(enable_timing) + record()", lambda: torch.cuda.Event(enable_timing=True).record())
current = torch.cuda.current_stream()
timed("Event(enable_timing) + record(stream)", lambda: torch.cuda.Event(enable_timing=True).record(current))
timed("torch.empty(1M int32, cuda)", lambda: torch.empty(1 << 20, dtype=torch.int32, device="cuda"))
timed("torch.empty(64M int32, cuda)", lambda: torch.empty(1 << 26, dtype=torch.int32, device="cuda"))
timed("tensor.data_ptr()", wl.q.data_ptr)
timed("tensor.stride()", wl.q.stride)
timed("python loop 1000 adds (CPU speed)", lambda: sum(range(1000)))
