"""The fast path reads nothing back from the device: index provenance, host copies, sync-free chunked selection.

CPU tests check the mechanisms (which checks are skipped and which still run, that
the sync-free constructions equal their references); the GPU tests count the
synchronisations with PyTorch's sync debug mode (:class:`fpv2.serving.soak.SyncCounter`).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from conftest import hopper_runs_here

from fpv2.index import SelectionConfig, build_block_index, register_strategy, unregister_strategy
from fpv2.index.strategies.max_threshold import MaxThresholdStrategy
from fpv2.kernel import BlockIndex, PagedPrefillBatch
from fpv2.kernel.contracts import HostBatchView, num_query_tiles
from fpv2.kernel.testing import planted_workload
from fpv2.serving import chunked_selection
from fpv2.serving.chunked import ChunkedPrefillPipeline
from fpv2.serving.chunked_pooling import batch_from_host
from fpv2.serving.chunked_selection import dense_block_index, densify_segments, uniform_dense_tail
from fpv2.serving.pipeline import SparsePrefillPipeline, is_builtin_strategy
from fpv2.serving.soak import SyncCounter
from fpv2.serving.transfer import device_ints

HQ, HKV, D = 8, 2, 64
GROUP = HQ // HKV
CONFIG = SelectionConfig(alpha=0.1, sink_tokens=128, window_tokens=128, dense_tail_tiles=2, min_sparse_kv_len=0)


def kept_lists(index: BlockIndex) -> list[list[int]]:
    offsets = index.offsets.tolist()
    blocks = index.blocks[: offsets[-1]].tolist()
    return [blocks[a:z] for a, z in itertools.pairwise(offsets)]


@pytest.fixture(scope="module")
def workload():
    """Two requests (the second over a 200-token cached prefix), page size 16, fp32."""
    return planted_workload(
        [700, 500], [700, 700], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=16, dtype=torch.float32, seed=2
    )


class _NoDeviceRead:
    """Makes the device-reading part of ``BlockIndex.check_compatible`` fail loudly if it runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0

        def refuse(index, batch):
            self.calls += 1
            raise AssertionError("check_compatible read the index values")

        monkeypatch.setattr(BlockIndex, "_causal_violations", refuse)


# ---------------------------------------------------------------------- index provenance
def test_assume_compatible_skips_the_device_reads_and_keeps_the_host_checks(workload, monkeypatch):
    index = build_block_index(workload.q, workload.k_cache, workload.batch, config=CONFIG)
    assert index.assume_compatible(workload.batch, GROUP) is index
    guard = _NoDeviceRead(monkeypatch)
    index.check_compatible(workload.batch, GROUP, tile_size=CONFIG.tile_size)  # no device read
    assert guard.calls == 0
    with pytest.raises(ValueError, match="tile_size"):  # the metadata checks still run every time
        index.check_compatible(workload.batch, GROUP, tile_size=64)
    with pytest.raises(ValueError, match="group"):
        index.assume_compatible(workload.batch, 2 * GROUP)
    # Another batch is not covered: its request count or tile count is refused on the host.
    other = PagedPrefillBatch.contiguous([700], [700], page_size=16)
    with pytest.raises(ValueError, match="requests"):
        index.assume_compatible(other, GROUP)
    shorter = PagedPrefillBatch.contiguous([600, 500], [600, 700], page_size=16)
    with pytest.raises(ValueError, match="segments"):
        index.assume_compatible(shorter, GROUP)
    with pytest.raises(AssertionError, match="read the index"):  # unchecked batch: the full check runs
        index.check_compatible(PagedPrefillBatch.contiguous([700, 500], [700, 700], page_size=16), GROUP)


def test_pipeline_vouches_for_builtin_strategies_only(workload, monkeypatch):
    calls = []
    original = BlockIndex._causal_violations

    def counting(index, batch):
        calls.append(batch)
        return original(index, batch)

    monkeypatch.setattr(BlockIndex, "_causal_violations", counting)
    args = (workload.q, workload.k_cache, workload.v_cache, workload.batch)
    assert is_builtin_strategy("max_threshold") and is_builtin_strategy("dense")
    SparsePrefillPipeline(CONFIG, backend="reference")(*args)
    assert calls == []  # built-in strategy: recorded as built for the batch, not re-read
    SparsePrefillPipeline(CONFIG, backend="reference", check_index=True)(*args)
    assert len(calls) == 1  # asked for: checked on the device once (the kernel)

    class Outside(MaxThresholdStrategy):
        """A third-party strategy: same selection, but not fpv2.index's own code."""

    Outside.__module__ = "someone_elses.selection"
    register_strategy("outside_test", Outside)
    try:
        assert not is_builtin_strategy("outside_test")
        calls.clear()
        SparsePrefillPipeline(CONFIG, strategy="outside_test", backend="reference")(*args)
        assert len(calls) == 1  # its index is checked
    finally:
        unregister_strategy("outside_test")
    with pytest.raises(TypeError, match="check_index"):
        SparsePrefillPipeline(CONFIG, check_index=1)


def test_host_view_is_one_copy_of_both_arrays():
    batch = PagedPrefillBatch(
        torch.tensor([0, 5, 5, 12], dtype=torch.int32),
        torch.tensor([9, 3, 12], dtype=torch.int32),
        torch.zeros(3, 12, dtype=torch.int32),
        page_size=1,
        num_pages=12,
    )
    assert batch.host == HostBatchView(cu_seqlens_q=[0, 5, 5, 12], seqlens_k=[9, 3, 12])
    assert batch.host.q_lens == [5, 0, 7] and batch.host.prefix == [4, 3, 5]


# ---------------------------------------------------------------------- host copies
def test_device_ints_copies_values_and_refuses_bad_input():
    out = device_ints([3, -1, 7], "cpu")
    assert out.dtype == torch.int32 and out.tolist() == [3, -1, 7]
    assert device_ints(torch.tensor([[1, 2], [3, 4]]), "cpu", dtype=torch.int64).tolist() == [1, 2, 3, 4]
    with pytest.raises(TypeError, match="integer dtype"):
        device_ints([1], "cpu", dtype=torch.float32)
    batch = batch_from_host([3, 0, 4], [5, 2, 4], torch.zeros(3, 5, dtype=torch.int32), page_size=1, num_pages=5)
    assert batch.cu_seqlens_q.tolist() == [0, 3, 3, 7] and batch.seqlens_k.tolist() == [5, 2, 4]
    assert batch.host.cu_seqlens_q == [0, 3, 3, 7]
    batch.validate_values()


# ---------------------------------------------------------------- sync-free chunk selection
def test_uniform_dense_tail():
    def mask(tiles: int, dense: int) -> torch.Tensor:
        return torch.arange(tiles) >= tiles - dense

    assert uniform_dense_tail([mask(8, 0), mask(5, 0)]) == 0  # middle chunks
    assert uniform_dense_tail([mask(8, 2), mask(5, 2)]) == 2  # both end here
    assert uniform_dense_tail([mask(8, 2), mask(1, 1)]) == 2  # a one-tile request is wholly dense under 2
    assert uniform_dense_tail([mask(8, 8), mask(5, 5)]) == 8  # short prompts: all dense
    assert uniform_dense_tail([mask(8, 3), mask(2, 2), mask(0, 0)]) == 3
    assert uniform_dense_tail([mask(8, 2), mask(5, 0)]) is None  # one ends, one goes on
    assert uniform_dense_tail([mask(8, 2), mask(5, 5)]) is None  # 5 tiles all dense needs a tail >= 5
    holes = torch.tensor([True, False, True])
    assert uniform_dense_tail([holes]) is None


def test_dense_block_index_equals_the_dense_strategy(workload):
    ours = dense_block_index(workload.batch, num_kv_heads=HKV, group=GROUP, tile_size=128, block_size=128)
    ours.validate_values()
    ours.check_compatible(workload.batch, GROUP, tile_size=128)
    theirs = build_block_index(workload.q, workload.k_cache, workload.batch, config=CONFIG, strategy="dense")
    assert torch.equal(ours.offsets, theirs.offsets) and torch.equal(ours.tile_offsets, theirs.tile_offsets)
    assert kept_lists(ours) == kept_lists(theirs)
    masks = [torch.ones(num_query_tiles(n, GROUP), dtype=torch.bool) for n in workload.batch.host.q_lens]
    none = densify_segments(None, workload.batch, masks, num_kv_heads=HKV, group=GROUP, tile_size=128, block_size=128)
    assert kept_lists(none) == kept_lists(theirs)


def test_densify_spare_capacity_equals_a_dense_rewrite(workload):
    config = dataclasses.replace(CONFIG, dense_tail_tiles=0)
    index = build_block_index(workload.q, workload.k_cache, workload.batch, config=config)
    masks = [torch.arange(num_query_tiles(n, GROUP)) % 3 == 1 for n in workload.batch.host.q_lens]
    out = densify_segments(index, workload.batch, masks, num_kv_heads=HKV, group=GROUP, tile_size=128, block_size=128)
    out.validate_values()
    assert out.blocks.numel() >= out.nnz and bool((out.blocks[out.nnz :] == -1).all())
    dense = kept_lists(dense_block_index(workload.batch, num_kv_heads=HKV, group=GROUP, tile_size=128, block_size=128))
    before, after = kept_lists(index), kept_lists(out)
    flags = [bool(m[t]) for m, n in zip(masks, workload.batch.host.q_lens) for _ in range(HKV) for t in range(len(m))]
    assert len(flags) == len(after)
    for s, is_dense in enumerate(flags):
        assert after[s] == (dense[s] if is_dense else before[s])


def test_chunk_selection_takes_the_dense_tail_to_the_index_not_a_second_pass(monkeypatch):
    """Single-request chunks: the whole-prompt tail goes into the strategy's config, densify never runs."""
    wl = planted_workload([2048], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=16, seed=4)
    config = dataclasses.replace(CONFIG, min_sparse_kv_len=1024)
    whole = SparsePrefillPipeline(config, backend="reference")(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    calls = []
    original = chunked_selection.densify_segments
    monkeypatch.setattr(chunked_selection, "densify_segments", lambda *a, **k: calls.append(1) or original(*a, **k))
    run = ChunkedPrefillPipeline(config, backend="reference").run(
        wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=512
    )
    assert calls == []
    assert run.dense_tiles == 2 and run.kept_pairs == whole.index.nnz
    torch.testing.assert_close(run.out, whole.out, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pipeline_and_chunked_prefill_make_no_host_sync():
    """Steady state (second call, host views seeded): dense, plain, chunk-aware and naive chunked runs sync zero times.

    Two requests whose chunks end at different times, so the chunk-aware run takes all three
    ways of :func:`select_chunk_blocks` (uniform tail, mixed tails with the densify pass).
    """
    wl = planted_workload(
        [16384, 12288], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, dtype=torch.bfloat16, device="cuda"
    )
    _ = wl.batch.host  # an engine seeds it; the harness reads it once, outside the counted calls
    config = SelectionConfig(min_sparse_kv_len=8192)
    plain = SparsePrefillPipeline(config, backend="triton")
    aware = ChunkedPrefillPipeline(config, backend="triton")
    naive = ChunkedPrefillPipeline(config, backend="triton", chunk_aware=False)
    dense = SparsePrefillPipeline(config, strategy="dense", correction=False, backend="triton")
    calls = {
        "dense": lambda: dense(wl.q, wl.k_cache, wl.v_cache, wl.batch),
        "plain": lambda: plain(wl.q, wl.k_cache, wl.v_cache, wl.batch),
        "aware": lambda: aware.run(wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=4096),
        "naive": lambda: naive.run(wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=4096),
    }
    counted = {}
    with SyncCounter(active=True) as counter:
        for name, call in calls.items():
            call()  # warm-up: compiles, workspaces, pinned host blocks
            torch.cuda.synchronize()
            counter.reset()
            result = call()
            counted[name] = counter.take()
            del result
    assert {name: count for name, (count, _) in counted.items()} == {"dense": 0, "plain": 0, "aware": 0, "naive": 0}, {
        name: dict(sites) for name, (_, sites) in counted.items()
    }


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(not hopper_runs_here(), reason="needs an sm_90 GPU and the native Hopper kernel")
@pytest.mark.parametrize("page_size", [1, 128])
def test_hopper_pipeline_makes_no_host_sync(page_size):
    """Steady state on the Hopper backend, corrected and not, the tile repack included at page size 1."""
    wl = planted_workload(
        [16384, 12288],
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=page_size,
        dtype=torch.bfloat16,
        device="cuda",
    )
    _ = wl.batch.host  # an engine seeds it; the harness reads it once, outside the counted calls
    config = SelectionConfig(min_sparse_kv_len=8192)
    calls = {
        "corrected": SparsePrefillPipeline(config, backend="hopper"),
        "uncorrected": SparsePrefillPipeline(config, correction=False, backend="hopper"),
        "dense": SparsePrefillPipeline(config, strategy="dense", correction=False, backend="hopper"),
    }
    counted = {}
    with SyncCounter(active=True) as counter:
        for name, pipeline in calls.items():
            pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch)  # warm-up: compiles, workspaces, pinned host blocks
            torch.cuda.synchronize()
            counter.reset()
            result = pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch)
            counted[name] = counter.take()
            del result
    assert {name: count for name, (count, _) in counted.items()} == dict.fromkeys(calls, 0), {
        name: dict(sites) for name, (_, sites) in counted.items()
    }
