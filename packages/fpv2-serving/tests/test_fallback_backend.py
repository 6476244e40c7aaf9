"""``auto`` on a Hopper GPU: the Hopper kernel where it serves the call, the next backend elsewhere."""

from __future__ import annotations

import pytest
import torch

from fpv2.kernel import PagedPrefillBatch
from fpv2.serving import backends as registry
from fpv2.serving.fallback_backend import FallbackBackend


class Recording:
    """A backend that records its calls; ``serves`` accepts page sizes that are multiples of ``page``."""

    derives_todo = True

    def __init__(self, name: str, page: int | None = None) -> None:
        self.name, self.page, self.calls = name, page, []

    def available(self) -> tuple[bool, str]:
        return True, f"{self.name} here"

    def auto_eligible(self) -> bool:
        return True

    def serves(self, q, k_cache, batch, index):
        return None if batch.page_size % self.page == 0 else f"page_size={batch.page_size}"

    def run(self, q, k_cache, v_cache, batch, index, plan, **kwargs):
        self.calls.append(("run", batch.page_size, index))
        return torch.full_like(q, float(len(self.name)))

    def run_dense(self, q, k_cache, v_cache, batch, **kwargs):
        self.calls.append(("run_dense", batch.page_size))
        return torch.full_like(q, -float(len(self.name)))


def _batch(page_size: int) -> PagedPrefillBatch:
    return PagedPrefillBatch.contiguous([4], [4], page_size=page_size)


def test_each_call_goes_to_the_backend_that_serves_it():
    primary, fallback = Recording("hopper", page=128), Recording("triton")
    backend = FallbackBackend(primary, fallback)
    q = torch.zeros(4, 2, 8)
    out = backend.run(q, None, None, _batch(128), "index", None, softmax_scale=None)
    assert backend.last_choice == ("hopper", None) and out[0, 0, 0].item() == len("hopper")
    out = backend.run(q, None, None, _batch(1), "index", None, softmax_scale=None)
    assert backend.last_choice == ("triton", "page_size=1") and out[0, 0, 0].item() == len("triton")
    out = backend.run_dense(q, None, None, _batch(16), softmax_scale=None)
    assert backend.last_choice == ("triton", "page_size=16") and out[0, 0, 0].item() == -len("triton")
    assert primary.calls == [("run", 128, "index")]
    assert fallback.calls == [("run", 1, "index"), ("run_dense", 16)]
    assert backend.name == "hopper" and backend.derives_todo is True
    assert "triton" in backend.available()[1]


class _Plan:
    """What the fallback reads of a correction plan: its mass shift."""

    def __init__(self, mass_shift: str) -> None:
        self.mass_shift = mass_shift


def test_a_plan_whose_shift_the_primary_does_not_apply_runs_on_the_fallback():
    primary, fallback = Recording("hopper", page=128), Recording("triton")
    primary.mass_shifts, fallback.mass_shifts = ("mean",), ("mean", "second_order")
    backend = FallbackBackend(primary, fallback)
    assert backend.mass_shifts == ("mean", "second_order")
    q = torch.zeros(4, 2, 8)
    backend.run(q, None, None, _batch(128), "index", _Plan("mean"), softmax_scale=None)
    assert backend.last_choice == ("hopper", None)
    backend.run(q, None, None, _batch(128), "index", _Plan("second_order"), softmax_scale=None, tile_copies="x")
    assert backend.last_choice == ("triton", "the hopper kernel does not apply the plan's mass_shift 'second_order'")
    assert primary.calls == [("run", 128, "index")] and fallback.calls == [("run", 128, "index")]
    # Backends that declare nothing apply the mean shift only.
    assert FallbackBackend(Recording("a", page=1), Recording("b")).mass_shifts == ("mean",)


def test_the_kv_layout_of_the_backend_that_ran_is_reported():
    primary, fallback = Recording("hopper", page=128), Recording("triton")
    backend = FallbackBackend(primary, fallback)
    assert backend.last_kv_layout is None  # no call yet
    q = torch.zeros(4, 2, 8)
    primary.last_kv_layout = "tile-repack"
    backend.run(q, None, None, _batch(128), "index", None, softmax_scale=None)
    assert backend.last_kv_layout == "tile-repack"
    backend.run(q, None, None, _batch(1), "index", None, softmax_scale=None)
    assert backend.last_kv_layout is None  # the fallback records none
    fallback.last_kv_layout = "paged"
    backend.run(q, None, None, _batch(1), "index", None, softmax_scale=None)
    assert backend.last_kv_layout == "paged"


def test_auto_wraps_a_partial_backend_but_a_named_one_is_used_as_is(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    primary, fallback = Recording("hopper", page=128), Recording("triton")
    registry.register_backend(primary, priority=0)
    registry.register_backend(fallback, priority=50)
    auto = registry.resolve_backend("auto")
    assert isinstance(auto, FallbackBackend) and auto.primary is primary and auto.fallback is fallback
    assert registry.resolve_backend("hopper") is primary


def test_hopper_backend_states_what_it_does_not_serve():
    hopper = registry.HopperBackend()
    q = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert "CUDA" in hopper.serves(q, None, _batch(128), None)
    if torch.cuda.is_available():
        cuda_q = q.cuda()
        assert hopper.serves(cuda_q, None, _batch(128), None) is None
        for page_size in (1, 16, 64):  # the lane-pair gather, measured faster than Triton: auto sends it too
            assert hopper.serves(cuda_q, None, _batch(page_size), None) is None
        assert "head dims" in hopper.serves(cuda_q[..., :96], None, _batch(128), None)  # built for none of 96
        from fpv2.kernel._native import hopper_head_dims

        for head_dim in hopper_head_dims():  # every built head dim measured faster than Triton: auto sends it
            d_q = torch.zeros(4, 2, head_dim, dtype=torch.bfloat16, device="cuda")
            assert hopper.serves(d_q, None, _batch(128), None) is None
        assert "bf16" in hopper.serves(cuda_q.half(), None, _batch(128), None)


def test_hopper_backend_sends_caches_it_cannot_read_as_rows_to_the_fallback():
    # A transformers layer's K is (B, Hkv, L, d): viewed as 128-token pages its head stride is L * d, which the
    # kernel's (num_pages * page_size, Hkv * d) row view cannot read (seen on the H200 as a refusal).
    problem = registry.HopperBackend._cache_layout_problem
    rows = torch.zeros(4, 128, 2, 128, dtype=torch.bfloat16)
    assert problem(rows) is None
    assert problem(torch.zeros(4, 128, 3, 128, dtype=torch.bfloat16)[:, :, :2]) is None  # padded token rows
    head_major = torch.zeros(1, 2, 512, 128, dtype=torch.bfloat16).view(2, 4, 128, 128).permute(1, 2, 0, 3)
    assert "head stride d" in problem(head_major)
    pages_apart = torch.zeros(8, 128, 2, 128, dtype=torch.bfloat16)[::2]
    assert "contiguous pages" in problem(pages_apart)
    if torch.cuda.is_available():
        q = torch.zeros(4, 2, 128, dtype=torch.bfloat16, device="cuda")
        hopper = registry.HopperBackend()
        with pytest.MonkeyPatch.context() as env:
            # Without the tile repack the kernel cannot take such a view: the fallback runs it. (With the copy,
            # the default, the kernel serves it: test_hopper_backend_takes_caches_only_the_tile_repack_reads...)
            env.setenv("FPV2_HOPPER_REPACK", "0")
            assert "head stride d" in hopper.serves(q, head_major.cuda(), _batch(128).to("cuda"), None)


def test_hopper_backend_takes_caches_only_the_tile_repack_reads_when_the_copy_is_made(monkeypatch):
    pytest.importorskip("triton")
    from fpv2.serving.adapters.vllm_kv_cache import kv_cache_views

    hopper = registry.HopperBackend()
    # vLLM 0.33's per-layer buffer (num_blocks, Hkv, block_size, 2 d), head-major inside a block, read as K/V views.
    k_view, _ = kv_cache_views(torch.zeros(64, 2, 16, 256, dtype=torch.bfloat16), 128)
    assert "head stride d" in hopper._cache_layout_problem(k_view)
    whole_prompt = PagedPrefillBatch.contiguous([100], [100], page_size=16)
    monkeypatch.setenv("FPV2_HOPPER_REPACK", "auto")
    assert hopper._copy_reads(k_view, whole_prompt) and hopper._copies(k_view, whole_prompt)
    # A short chunk after a long prefix keeps the gather, which cannot read the view: the fallback runs it.
    short_chunk = PagedPrefillBatch.contiguous([1], [1000], page_size=16)  # under MIN_QUERY_SHARE (1/256)
    assert not hopper._copy_reads(k_view, short_chunk)
    monkeypatch.setenv("FPV2_HOPPER_REPACK", "0")
    assert not hopper._copy_reads(k_view, whole_prompt)
    monkeypatch.setenv("FPV2_HOPPER_REPACK", "1")
    assert not hopper._copy_reads(k_view.transpose(2, 3), whole_prompt)  # no unit element stride: no copy either
    # Tile-sized pages the kernel cannot read as they are are copied too (the kernel's only way to them); the
    # kernel's own readable tile pages never are.
    tile_view, _ = kv_cache_views(torch.zeros(2, 2, 128, 256, dtype=torch.bfloat16), 128)
    tile_batch = PagedPrefillBatch.contiguous([100], [100], page_size=128)
    assert hopper._copy_reads(tile_view, tile_batch) and hopper._copies(tile_view, tile_batch)
    readable = torch.zeros(2, 128, 2, 128, dtype=torch.bfloat16)
    assert hopper._cache_layout_problem(readable) is None and not hopper._copies(readable, tile_batch)
    if torch.cuda.is_available():
        q = torch.zeros(100, 4, 128, dtype=torch.bfloat16, device="cuda")
        assert hopper.serves(q, k_view.cuda(), whole_prompt.to("cuda"), None) is None
        assert hopper.serves(q, tile_view.cuda(), tile_batch.to("cuda"), None) is None
        monkeypatch.setenv("FPV2_HOPPER_REPACK", "0")
        assert "head stride d" in hopper.serves(q, tile_view.cuda(), tile_batch.to("cuda"), None)


@pytest.mark.parametrize("page_size", [1, 16])
def test_fallback_backend_matches_the_fallback_alone_on_pages_it_does_not_serve(page_size):
    # Through the real pipeline: the reference stands in for the portable backend.
    from fpv2.kernel.testing import planted_workload
    from fpv2.serving import SparsePrefillPipeline

    wl = planted_workload([256], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size, dtype=torch.float32)
    reference = registry.resolve_backend("reference")
    wrapped = FallbackBackend(Recording("hopper", page=128), reference)
    got = SparsePrefillPipeline(backend=wrapped)(wl.q, wl.k_cache, wl.v_cache, wl.batch).out
    want = SparsePrefillPipeline(backend=reference)(wl.q, wl.k_cache, wl.v_cache, wl.batch).out
    assert wrapped.last_choice == ("reference", f"page_size={page_size}")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dense_strategy_runs_the_backends_dense_mode_and_equals_the_full_csr():
    # The "dense" strategy without correction calls run_dense (no CSR walk) when the backend has one;
    # its output must equal the backend run over the index of every visible block.
    from fpv2.kernel.testing import planted_workload
    from fpv2.serving import SparsePrefillPipeline
    from fpv2.serving.pipeline import DENSE_STRATEGY

    reference = registry.resolve_backend("reference")

    class WithDenseMode:
        name, derives_todo = "with-dense-mode", False

        def __init__(self) -> None:
            self.calls = []

        def available(self):
            return True, "here"

        def run(self, *args, **kwargs):
            self.calls.append("run")
            return reference.run(*args, **kwargs)

        def run_dense(self, q, k_cache, v_cache, batch, **kwargs):
            self.calls.append("run_dense")
            full = SparsePrefillPipeline(strategy=DENSE_STRATEGY, correction=False, backend=reference)
            return full(q, k_cache, v_cache, batch).out

    wl = planted_workload([300], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32)
    backend = WithDenseMode()
    dense = SparsePrefillPipeline(strategy=DENSE_STRATEGY, correction=False, backend=backend)
    got = dense(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert backend.calls == ["run_dense"] and got.index.density(wl.batch) == 1.0
    want = SparsePrefillPipeline(strategy=DENSE_STRATEGY, correction=False, backend=reference)(
        wl.q, wl.k_cache, wl.v_cache, wl.batch
    )
    torch.testing.assert_close(got.out, want.out, rtol=0, atol=0)
    SparsePrefillPipeline(correction=False, backend=backend)(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert backend.calls == ["run_dense", "run"]  # a sparse strategy walks its CSR


@pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel needs a GPU or the interpreter",
)
def test_triton_dense_mode_equals_its_run_over_every_visible_block():
    from fpv2.kernel.testing import planted_workload
    from fpv2.serving import SparsePrefillPipeline
    from fpv2.serving.pipeline import DENSE_STRATEGY

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    wl = planted_workload([200], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=dtype, device=device)
    triton = registry.TritonBackend()
    got = SparsePrefillPipeline(strategy=DENSE_STRATEGY, correction=False, backend=triton)(
        wl.q, wl.k_cache, wl.v_cache, wl.batch
    )
    index = got.index
    want = triton.run(wl.q, wl.k_cache, wl.v_cache, wl.batch, index, None, softmax_scale=None, q_descale=None,
                      k_descale=None, v_descale=None)  # fmt: skip
    torch.testing.assert_close(got.out.float(), want.float(), rtol=1e-2, atol=1e-2)
