"""When the Hopper backend copies small pages into tile pages (``fpv2.serving.tile_repack_policy``).

The rule reads only the batch's host view: tests build batches on the CPU. The GPU tests at the end run
the Hopper backend at page size 1 with the copy forced on and off, and on vLLM's K/V views (which only
the copy reads), against the fp32 reference.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import hopper_runs_here

from fpv2.kernel import PagedPrefillBatch
from fpv2.serving import tile_repack_policy
from fpv2.serving.tile_repack_policy import (
    MAX_MEMORY_SHARE,
    MIN_QUERY_SHARE,
    REPACK_ENV,
    repack_mode,
    should_repack,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _batch(seqlens_q: list[int], seqlens_k: list[int], page_size: int) -> PagedPrefillBatch:
    return PagedPrefillBatch.contiguous(seqlens_q, seqlens_k, page_size=page_size)


@pytest.mark.skipif(not HAS_TRITON, reason="the copy is a Triton kernel")
def test_auto_copies_small_pages_of_whole_prompts_only() -> None:
    assert should_repack(_batch([32768], [32768], 1), 128, "auto")
    assert should_repack(_batch([100, 3000], [100, 3000], 16), 128, "auto")
    # A chunk after a long cached prefix: copied from 1/256 of the keys on (measured to pay there), not below.
    assert MIN_QUERY_SHARE == 1 / 256
    assert should_repack(_batch([512], [131072], 1), 128, "auto")
    assert not should_repack(_batch([256], [131072], 1), 128, "auto")
    # The share is counted over the whole batch, at the boundary included.
    share = int(MIN_QUERY_SHARE * 4096)
    assert should_repack(_batch([share], [4096], 1), 128, "auto")
    assert not should_repack(_batch([share - 1], [4096], 1), 128, "auto")
    # Pages that are a multiple of the tile never need it, whatever the mode.
    for mode in ("auto", "1", "0"):
        assert not should_repack(_batch([4096], [4096], 256), 128, mode)
        assert not should_repack(_batch([4096], [4096], 128), 128, mode)


@pytest.mark.skipif(not HAS_TRITON, reason="the copy is a Triton kernel")
def test_modes_force_the_copy_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = _batch([128], [131072], 1)
    whole = _batch([4096], [4096], 1)
    assert should_repack(chunk, 128, "1") and not should_repack(whole, 128, "0")
    monkeypatch.setenv(REPACK_ENV, "1")
    assert repack_mode() == "1" and should_repack(chunk, 128)
    monkeypatch.setenv(REPACK_ENV, "0")
    assert not should_repack(whole, 128)
    monkeypatch.setenv(REPACK_ENV, "")
    assert repack_mode() == "auto" and should_repack(whole, 128)


@pytest.mark.skipif(not HAS_TRITON, reason="the copy is a Triton kernel")
def test_auto_leaves_the_copy_out_when_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    from fpv2.kernel.triton.tile_repack import tile_repack_bytes

    batch = _batch([4096], [4096], 1)
    k_cache = torch.zeros(batch.num_pages, 1, 2, 64, dtype=torch.float16)
    needed = tile_repack_bytes(k_cache, batch)
    assert needed == 2 * 32 * 128 * 2 * 64 * 2
    asked = []
    monkeypatch.setattr(tile_repack_policy, "copies_fit", lambda n, device: asked.append(n) or False)
    assert not should_repack(batch, 128, "auto", k_cache=k_cache) and asked == [needed]
    assert should_repack(batch, 128, "1", k_cache=k_cache)  # forced: the caller asked for it
    assert should_repack(batch, 128, "auto")  # no cache given: no memory check
    monkeypatch.undo()
    assert tile_repack_policy.repack_headroom_bytes(torch.device("cpu")) is None  # off CUDA: no limit
    assert should_repack(batch, 128, "auto", k_cache=k_cache)


def test_copies_fit_reads_the_allocator_only_when_free_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    free, headroom, allocator_reads = 1000, 3000, []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 10_000))
    monkeypatch.setattr(
        tile_repack_policy, "repack_headroom_bytes", lambda device: allocator_reads.append(device) or headroom
    )
    assert tile_repack_policy.copies_fit(int(MAX_MEMORY_SHARE * free), cuda) and allocator_reads == []
    assert tile_repack_policy.copies_fit(int(MAX_MEMORY_SHARE * headroom), cuda) and len(allocator_reads) == 1
    assert not tile_repack_policy.copies_fit(int(MAX_MEMORY_SHARE * headroom) + 1, cuda)
    assert tile_repack_policy.copies_fit(10**12, torch.device("cpu"))  # off CUDA: no limit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_headroom_is_free_memory_plus_the_allocators_unused_blocks() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    held = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    del held  # 64 MiB now cached by the allocator, unused
    free, _ = torch.cuda.mem_get_info(device)
    want = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert tile_repack_policy.repack_headroom_bytes(device) == want
    assert want - free >= 64 << 20


@pytest.mark.skipif(not HAS_TRITON, reason="the copy is a Triton kernel")
def test_caches_the_kernel_cannot_read_are_copied_at_any_page_size(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _batch([4096], [4096], 128)
    assert not should_repack(whole, 128, "auto")  # the kernel reads tile pages itself
    assert should_repack(whole, 128, "auto", kernel_reads_pages=False)
    assert not should_repack(_batch([4096], [4096], 256), 128, "auto")
    assert should_repack(_batch([4096], [4096], 256), 128, "auto", kernel_reads_pages=False)
    # The rest of the rule holds: short chunks after a long prefix, and mode 0, keep the cache as it is.
    assert not should_repack(_batch([8], [4096], 128), 128, "auto", kernel_reads_pages=False)
    assert not should_repack(whole, 128, "0", kernel_reads_pages=False)


def test_unknown_modes_are_refused_with_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPACK_ENV, "yes")
    with pytest.raises(ValueError, match=r"FPV2_HOPPER_REPACK='yes': expected one of 'auto', '0', '1'"):
        should_repack(_batch([64], [64], 1), 128)
    with pytest.raises(ValueError, match="repack mode must be one of"):
        should_repack(_batch([64], [64], 1), 128, "always")


def test_without_triton_auto_keeps_the_gather_and_1_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        tile_repack_policy.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    assert not should_repack(_batch([4096], [4096], 1), 128, "auto")
    with pytest.raises(ImportError, match="FPV2_HOPPER_REPACK=1: the tile repack is a Triton kernel"):
        should_repack(_batch([4096], [4096], 1), 128, "1")


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not hopper_runs_here(), reason="needs an sm_90 GPU and the native Hopper kernel")
def test_hopper_backend_at_page_1_matches_the_reference_with_and_without_the_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fpv2.kernel.reference import dense_attention
    from fpv2.kernel.testing.workloads import planted_workload
    from fpv2.serving import SparsePrefillPipeline

    wl = planted_workload([1000, 3000], num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=1, device="cuda")
    want = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    outs = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(REPACK_ENV, mode)
        pipeline = SparsePrefillPipeline(strategy="dense", correction=False, backend="hopper")
        outs[mode] = pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch).out.float()
        err = ((outs[mode] - want).norm() / want.norm()).item()
        assert err < 1e-2, (mode, err)
    # Both paths compute the same exact attention from the same bf16 values.
    torch.testing.assert_close(outs["1"], outs["0"], rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not hopper_runs_here(), reason="needs an sm_90 GPU and the native Hopper kernel")
def test_vllm_views_run_on_the_kernel_through_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    from fpv2.kernel.reference import dense_attention
    from fpv2.kernel.testing.workloads import planted_workload
    from fpv2.serving import SparsePrefillPipeline
    from fpv2.serving.adapters.vllm_kv_cache import kv_cache_views, paged_as_kv_cache

    monkeypatch.setenv(REPACK_ENV, "auto")
    wl = planted_workload([700, 1500], num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=16, device="cuda")
    k_view, v_view = kv_cache_views(paged_as_kv_cache(wl.k_cache, wl.v_cache, "HND"), 128)
    torch.testing.assert_close(k_view, wl.k_cache, rtol=0, atol=0, equal_nan=True)
    pipeline = SparsePrefillPipeline(strategy="dense", correction=False)  # auto: the Hopper kernel where it serves
    got = pipeline(wl.q, k_view, v_view, wl.batch).out.float()
    assert pipeline.backend.last_choice == ("hopper", None)
    assert pipeline.backend.last_kv_layout == "tile-repack"
    want = dense_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not hopper_runs_here(), reason="needs an sm_90 GPU and the native Hopper kernel")
@pytest.mark.parametrize("kv_len", [2048, 1000])  # pages of 128 (tile-sized) and of 8 tokens
def test_transformers_head_major_views_run_on_the_kernel_through_the_copy(kv_len: int) -> None:
    from fpv2.kernel.reference import dense_attention
    from fpv2.serving import SparsePrefillPipeline
    from fpv2.serving.adapters.transformers_kv_view import dense_kv_as_pages
    from fpv2.serving.backends import HopperBackend

    gen = torch.Generator(device="cuda").manual_seed(1)
    # A transformers layer's (B, Hkv, T, d) cache with spare slots past kv_len: head stride T * d.
    key = torch.randn(2, 4, kv_len + 64, 128, device="cuda", generator=gen).bfloat16()
    value = torch.randn(2, 4, kv_len + 64, 128, device="cuda", generator=gen).bfloat16()
    view = dense_kv_as_pages(key, value, kv_len, kv_len)
    assert not view.copied and HopperBackend._cache_layout_problem(view.k_cache) is not None
    q = torch.randn(2 * kv_len, 16, 128, device="cuda", generator=gen).bfloat16()
    pipeline = SparsePrefillPipeline(strategy="dense", correction=False)  # auto: the Hopper kernel where it serves
    got = pipeline(q, view.k_cache, view.v_cache, view.batch).out.float()
    assert pipeline.backend.last_choice == ("hopper", None)
    assert pipeline.backend.last_kv_layout == "tile-repack"
    want = dense_attention(q, view.k_cache, view.v_cache, view.batch)
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, err
