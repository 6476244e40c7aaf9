"""The tile repack issued ahead of the attention call (``fpv2.serving.tile_repack_staging``).

On the CPU the copy runs under the Triton interpreter on the caller's stream; the Hopper backend's
``run`` is exercised with the native call replaced by a recorder (the library needs an sm_90 GPU), so
the tests see which caches the kernel would have been given. The GPU test at the end runs the
corrected pipeline at page size 1 with the side-stream copy on and off against the fp32 reference.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fpv2.kernel.testing.workloads import planted_workload
from fpv2.serving.backends import HopperBackend
from fpv2.serving.fallback_backend import FallbackBackend
from fpv2.serving.tile_repack_policy import REPACK_ENV
from fpv2.serving.tile_repack_staging import stage_tile_repack

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the copy is a Triton kernel")


def _small_workload(seed: int = 3):
    return planted_workload([130, 200], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=1, seed=seed)


class _CpuHopper(HopperBackend):
    """The Hopper backend with ``serves`` accepting CPU calls and the native call recorded, not run."""

    def __init__(self) -> None:
        self.kernel_inputs: list[tuple[torch.Tensor, torch.Tensor, object]] = []

    def serves(self, q, k_cache, batch, index):
        return None


@pytest.fixture
def recorded_kernel(monkeypatch: pytest.MonkeyPatch):
    """Replace ``hopper_prefill`` by a recorder of the caches it is handed."""
    from fpv2.kernel import _native

    seen: list[tuple[torch.Tensor, torch.Tensor, object]] = []

    def fake_prefill(q, k_cache, v_cache, out, batch, **kwargs):
        seen.append((k_cache, v_cache, batch))
        return out.zero_()

    monkeypatch.setattr(_native, "hopper_prefill", fake_prefill, raising=False)
    return seen


def _run(backend: HopperBackend, wl) -> None:
    backend.run(
        wl.q,
        wl.k_cache,
        wl.v_cache,
        wl.batch,
        None,
        None,
        softmax_scale=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
    )


@needs_triton
def test_a_staged_copy_is_claimed_by_its_own_call_only() -> None:
    from fpv2.kernel.triton.tile_repack import repack_to_tile_pages

    wl = _small_workload()
    staged = stage_tile_repack(wl.k_cache, wl.v_cache, wl.batch, None)
    assert not staged.on_side_stream  # no side stream on the CPU
    assert staged.matches(wl.k_cache, wl.v_cache, wl.batch)
    other = _small_workload()
    assert not staged.matches(other.k_cache, wl.v_cache, wl.batch)
    assert not staged.matches(wl.k_cache, wl.v_cache, other.batch)
    got = staged.claim()
    want = repack_to_tile_pages(wl.k_cache, wl.v_cache, wl.batch)
    torch.testing.assert_close(got.k_cache, want.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(got.v_cache, want.v_cache, rtol=0, atol=0)
    torch.testing.assert_close(got.batch.page_table, want.batch.page_table, rtol=0, atol=0)


@needs_triton
def test_run_uses_the_copy_prepare_staged(recorded_kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPACK_ENV, "1")
    wl = _small_workload()
    backend = _CpuHopper()
    backend.prepare(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    staged = backend._staged
    assert staged is not None
    _run(backend, wl)
    k_cache, v_cache, batch = recorded_kernel[-1]
    # The kernel got the staged tensors themselves, not a second copy.
    assert k_cache is staged.repacked.k_cache and v_cache is staged.repacked.v_cache
    assert batch is staged.repacked.batch and batch.page_size == 128
    assert backend.last_kv_layout == "tile-repack" and backend._staged is None
    # The CPU copy ran on the caller's stream.
    assert backend.last_repack_stream == "inline"


@needs_triton
def test_a_call_on_other_caches_drops_the_staged_copy(recorded_kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPACK_ENV, "1")
    from fpv2.kernel.triton.tile_repack import repack_to_tile_pages

    staged_for, called = _small_workload(), _small_workload(seed=4)
    backend = _CpuHopper()
    backend.prepare(staged_for.q, staged_for.k_cache, staged_for.v_cache, staged_for.batch)
    staged = backend._staged
    _run(backend, called)
    k_cache, _, batch = recorded_kernel[-1]
    assert k_cache is not staged.repacked.k_cache and batch.page_size == 128  # copied again, from its own caches
    assert torch.equal(k_cache, repack_to_tile_pages(called.k_cache, called.v_cache, called.batch).k_cache)
    assert backend._staged is None


@needs_triton
def test_nothing_is_staged_when_the_copy_is_off_or_the_kernel_refuses(
    recorded_kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    wl = _small_workload()
    backend = _CpuHopper()
    monkeypatch.setenv(REPACK_ENV, "0")
    backend.prepare(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert backend._staged is None
    _run(backend, wl)
    assert recorded_kernel[-1][0] is wl.k_cache and backend.last_kv_layout == "paged"
    assert backend.last_repack_stream is None
    monkeypatch.setenv(REPACK_ENV, "1")
    backend.overlap_repack = False
    backend.prepare(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert backend._staged is None
    _run(backend, wl)
    assert backend.last_kv_layout == "tile-repack" and backend.last_repack_stream == "inline"
    # The unpatched backend refuses CPU inputs in ``serves``: nothing is copied for a call it will not run.
    plain = HopperBackend()
    plain.prepare(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert plain._staged is None


class _Staging:
    """A primary that records ``prepare`` / ``release_staged`` and serves page sizes that are multiples of 128."""

    name = "hopper"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def serves(self, q, k_cache, batch, index):
        return None if batch.page_size % 128 == 0 else f"page_size={batch.page_size}"

    def prepare(self, q, k_cache, v_cache, batch):
        self.calls.append("prepare")

    def release_staged(self):
        self.calls.append("release")

    def run(self, q, k_cache, v_cache, batch, index, plan, **kwargs):
        self.calls.append("run")
        return q


class _Plain:
    name = "triton"

    def run(self, q, k_cache, v_cache, batch, index, plan, **kwargs):
        return q


def test_the_fallback_forwards_prepare_and_releases_when_the_call_goes_elsewhere() -> None:
    from fpv2.kernel import PagedPrefillBatch

    primary = _Staging()
    backend = FallbackBackend(primary, _Plain())
    q = torch.zeros(4, 2, 8)
    for page_size in (128, 1):
        batch = PagedPrefillBatch.contiguous([4], [4], page_size=page_size)
        backend.prepare(q, None, None, batch)
        backend.run(q, None, None, batch, None, None, softmax_scale=None)
    assert primary.calls == ["prepare", "run", "prepare", "release"]


class _FailingIndex(Exception):
    pass


@needs_triton
def test_the_pipeline_prepares_before_the_index_and_releases_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from fpv2.serving import pipeline as pipeline_module
    from fpv2.serving.pipeline import SparsePrefillPipeline

    wl = _small_workload()
    events: list[str] = []

    class Backend(_Staging):
        def prepare(self, q, k_cache, v_cache, batch):
            assert k_cache is wl.k_cache and v_cache is wl.v_cache and batch is wl.batch
            events.append("prepare")

        def release_staged(self):
            events.append("release")

        def available(self):
            return True, "here"

        def run(self, q, k_cache, v_cache, batch, index, plan, **kwargs):
            events.append("run")
            return torch.zeros_like(q)

    real_index = pipeline_module._build_block_index

    def recorded_index(*args, **kwargs):
        events.append("index")
        return real_index(*args, **kwargs)

    monkeypatch.setattr(pipeline_module, "_build_block_index", recorded_index)
    pipeline = SparsePrefillPipeline(correction=True, backend=Backend())
    pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert events == ["prepare", "index", "run"]

    def failing_index(*args, **kwargs):
        raise _FailingIndex

    events.clear()
    monkeypatch.setattr(pipeline_module, "_build_block_index", failing_index)
    with pytest.raises(_FailingIndex):
        pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert events == ["prepare", "release"]


def _hopper_runs_here() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    return HopperBackend().available()[0]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not _hopper_runs_here(), reason="needs an sm_90 GPU and the native Hopper kernel")
def test_the_side_stream_copy_gives_the_inline_copys_output(monkeypatch: pytest.MonkeyPatch) -> None:
    from fpv2.kernel.reference import dense_attention
    from fpv2.serving import SparsePrefillPipeline

    monkeypatch.setenv(REPACK_ENV, "1")
    wl = planted_workload([1000, 3000], num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=1, device="cuda")
    want = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    outs = {}
    for overlap in (True, False):
        backend = HopperBackend()
        backend.overlap_repack = overlap
        pipeline = SparsePrefillPipeline(strategy="dense", correction=False, backend=backend)
        # Poison the caller's stream with a long kernel first: a copy that did not wait for it would read
        # caches that are still being written.
        k_cache, v_cache = torch.zeros_like(wl.k_cache), torch.zeros_like(wl.v_cache)
        torch.cuda._sleep(20_000_000)
        k_cache.copy_(wl.k_cache)
        v_cache.copy_(wl.v_cache)
        outs[overlap] = pipeline(wl.q, k_cache, v_cache, wl.batch).out.float()
        assert backend.last_kv_layout == "tile-repack"
        assert backend.last_repack_stream == ("side-stream" if overlap else "inline")
        err = ((outs[overlap] - want).norm() / want.norm()).item()
        assert err < 1e-2, (overlap, err)
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not _hopper_runs_here(), reason="needs an sm_90 GPU and the native Hopper kernel")
def test_vllm_views_run_on_the_kernel_through_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from fpv2.kernel.reference import dense_attention
    from fpv2.serving import SparsePrefillPipeline
    from fpv2.serving.adapters.vllm_kv_cache import kv_cache_views

    monkeypatch.setenv(REPACK_ENV, "auto")
    wl = planted_workload([700, 1500], num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16, device="cuda")
    buffer = torch.cat([wl.k_cache, wl.v_cache], dim=-1).transpose(1, 2).contiguous()  # vLLM's (blocks, Hkv, 16, 2d)
    k_view, v_view = kv_cache_views(buffer, 128)
    torch.testing.assert_close(k_view, wl.k_cache, rtol=0, atol=0, equal_nan=True)
    pipeline = SparsePrefillPipeline(strategy="dense", correction=False)  # auto: the Hopper kernel where it serves
    got = pipeline(wl.q, k_view, v_view, wl.batch).out.float()
    assert pipeline.backend.last_choice == ("hopper", None)
    assert pipeline.backend.last_kv_layout == "tile-repack"
    want = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, err
