"""Host side of the Triton index stage: fewer launches, fewer allocations, cheaper relaunches.

- the prefix sum of the counts runs inside the selection kernel (:mod:`fpv2.index.triton.scan`),
  bit-identical to ``torch.cumsum``, empty segments included;
- pooling writes the scoring copy of the keys bit-identical to the preparation kernel, and the
  selection uses it only while it still describes ``pooled_k``;
- a repeated call at one shape reuses the workspace's buffers and views; outputs stay fresh;
- :class:`~fpv2.kernel.triton.relaunch.Relauncher` launches the index's kernels normally under the
  interpreter and relaunches them on a GPU with the normal launches' results (its own unit tests are
  the kernel package's ``test_triton_relaunch.py``);
- :class:`~fpv2.index.triton.GraphedIndex` replays the eager index and refuses the CPU.

CPU runs use the Triton interpreter (``TRITON_INTERPRET=1``); ``gpu`` tests need CUDA.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

# The Triton index tests' shared skip rules and device (pytest applies the imported ``pytestmark``).
from test_triton_index import DEVICE, HAS_CUDA, INTERPRET, needs_cuda, pytestmark  # noqa: E402, F401

from fpv2.index.config import SelectionConfig  # noqa: E402
from fpv2.index.triton import (  # noqa: E402
    GraphedIndex,
    IndexWorkspace,
    pool_blocks_triton,
    scoring,
    select_blocks_triton,
)
from fpv2.index.triton.compaction import segment_offsets  # noqa: E402
from fpv2.index.triton.outputs import PART_ALIGN, fresh_outputs  # noqa: E402
from fpv2.index.triton.prepared_keys import (  # noqa: E402
    DOT_FP16,
    TritonBlockStatistics,
    dot_kind,
    logit_scale_log2,
)
from fpv2.index.triton.scan import scan_counts  # noqa: E402
from fpv2.kernel.contracts import BlockIndex, BlockStatistics  # noqa: E402
from fpv2.kernel.testing import planted_workload  # noqa: E402
from fpv2.kernel.triton import relaunch as launcher  # noqa: E402

gpu = pytest.mark.gpu


def _config(**overrides: object) -> SelectionConfig:
    fields = dict(alpha=0.3, block_size=16, tile_size=64, sink_tokens=16, window_tokens=16)
    fields.update(dense_tail_tiles=1, min_sparse_kv_len=0)
    fields.update(overrides)
    return SelectionConfig(**fields)


def _workload(seed: int = 0, dtype: torch.dtype = torch.float16):
    return planted_workload(
        [96, 40, 1],
        [160, 40, 70],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
    )


def _same_index(a: BlockIndex, b: BlockIndex) -> bool:
    """Same offsets, tile offsets and first ``nnz`` block ids (the strict check)."""
    nnz = int(a.offsets[-1])
    return (
        torch.equal(a.offsets, b.offsets)
        and torch.equal(a.tile_offsets, b.tile_offsets)
        and torch.equal(a.blocks[:nnz], b.blocks[:nnz])
    )


# --------------------------------------------------------------------------- the fused prefix sum
@triton.jit
def _scan_kernel(counts_ptr, offsets_ptr, num_segments, SCAN: tl.constexpr):
    scan_counts(counts_ptr, offsets_ptr, num_segments, tl.program_id(0) * 0, SCAN)


@pytest.mark.parametrize("scan", [16, 64])
@pytest.mark.parametrize("num_segments", [1, 15, 16, 17, 64, 200])
def test_scan_counts_equals_torch_cumsum(scan: int, num_segments: int) -> None:
    gen = torch.Generator().manual_seed(num_segments * 7 + scan)
    counts = torch.randint(0, 40, (num_segments,), generator=gen, dtype=torch.int32)
    counts[torch.rand(num_segments, generator=gen) < 0.3] = 0  # empty segments
    counts = counts.to(DEVICE)
    offsets = torch.full((num_segments + 1,), -7, dtype=torch.int32, device=DEVICE)
    offsets[0] = 0  # the selection kernel's program 0 writes offsets[0]
    _scan_kernel[(1,)](counts, offsets, num_segments, SCAN=scan)
    assert torch.equal(offsets, segment_offsets(counts))


def test_selection_writes_offsets_as_the_cumsum_of_its_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    # A small scan step makes the last program's scan take several steps (with a carry) on a tiny batch.
    monkeypatch.setattr(scoring, "SCAN_COUNTS", 4)
    w = _workload()
    config = _config()
    stats = pool_blocks_triton(w.k_cache, None, w.batch, block_size=16)
    ws = IndexWorkspace(max_programs=3)
    index = select_blocks_triton(w.q, w.batch, stats, config=config, workspace=ws)
    counts = ws._counts[: index.num_segments]
    assert index.num_segments > 4
    assert torch.equal(index.offsets, segment_offsets(counts))
    assert int(ws._done) == 0  # the last program leaves the completion counter at 0 for the next call
    monkeypatch.setattr(scoring, "SCAN_COUNTS", 4096)
    again = select_blocks_triton(w.q, w.batch, stats, config=config, workspace=ws)
    assert _same_index(index, again)


def test_a_failed_selection_resets_the_completion_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _workload()
    stats = pool_blocks_triton(w.k_cache, None, w.batch, block_size=16)
    ws = IndexWorkspace(max_programs=2)
    select_blocks_triton(w.q, w.batch, stats, config=_config(), workspace=ws)

    def broken(*args: object, **kwargs: object) -> None:
        ws._done.fill_(1)  # as if one program had counted, then the launch failed
        raise RuntimeError("launch failed")

    monkeypatch.setattr("fpv2.index.triton.api.launch_score_select", broken)
    with pytest.raises(RuntimeError, match="launch failed"):
        select_blocks_triton(w.q, w.batch, stats, config=_config(), workspace=ws)
    assert int(ws._done) == 0


# --------------------------------------------------------------------------- keys prepared by the pooling kernel
@pytest.mark.parametrize(
    "cache_dtype,query_dtype", [(torch.float16, None), (torch.float32, None), (torch.float32, torch.float16)]
)
def test_pooled_scoring_keys_are_the_preparation_kernels_bits(cache_dtype, query_dtype) -> None:
    w = _workload(dtype=cache_dtype)
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16, query_dtype=query_dtype)
    assert isinstance(stats, TritonBlockStatistics) and isinstance(stats, BlockStatistics)
    prepared = stats.prepared_keys
    kind = dot_kind(query_dtype or cache_dtype, INTERPRET)
    scale = logit_scale_log2(None, 64)
    assert prepared.dot_kind == kind and prepared.scale_log2 == scale
    assert torch.equal(prepared.keys, scoring.launch_prepare_keys(stats.pooled_k, scale, kind))


def test_fp8_pooled_scoring_keys_are_the_preparation_kernels_bits() -> None:
    w = _workload(dtype=torch.float32)
    k8 = w.k_cache.clamp(-200, 200).to(torch.float8_e4m3fn)
    k_ds = torch.rand(3, 2, device=DEVICE) + 0.5
    stats = pool_blocks_triton(k8, None, w.batch, block_size=16, k_descale=k_ds, softmax_scale=0.3)
    assert stats.prepared_keys.dot_kind == DOT_FP16
    expected = scoring.launch_prepare_keys(stats.pooled_k, logit_scale_log2(0.3, 64), DOT_FP16)
    assert torch.equal(stats.prepared_keys.keys, expected)


def _count_preparations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = scoring.launch_prepare_keys

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr("fpv2.index.triton.api.launch_prepare_keys", counting)
    return calls


def test_selection_uses_the_pooled_keys_only_while_they_match(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_preparations(monkeypatch)
    w = _workload()
    config = _config()
    stats = pool_blocks_triton(w.k_cache, None, w.batch, block_size=16)
    plain = BlockStatistics(stats.pooled_k, None, stats.block_lengths, stats.block_offsets, 16)
    fast = select_blocks_triton(w.q, w.batch, stats, config=config)
    assert calls == []  # the pooling kernel's copy was used: no preparation launch
    slow = select_blocks_triton(w.q, w.batch, plain, config=config)  # other statistics: prepares its own
    assert calls == [1] and _same_index(fast, slow)
    select_blocks_triton(w.q, w.batch, stats, config=_config(softmax_scale=0.2))  # another scale
    assert calls == [1, 1]
    replaced = dataclasses.replace(stats, pooled_k=stats.pooled_k.clone())  # carries the copy of another tensor
    assert _same_index(select_blocks_triton(w.q, w.batch, replaced, config=config), fast)
    assert calls == [1, 1, 1]
    stats.pooled_k.mul_(2.0)  # in place: the copy no longer describes pooled_k
    doubled = select_blocks_triton(w.q, w.batch, stats, config=config)
    assert calls == [1, 1, 1, 1]
    assert _same_index(doubled, select_blocks_triton(w.q, w.batch, plain, config=config))


# --------------------------------------------------------------------------- allocations
def test_fresh_outputs_are_aligned_disjoint_views_of_one_allocation() -> None:
    parts = [((3, 2, 5), torch.float32), ((7,), torch.bfloat16), ((0,), torch.int32), ((129,), torch.int32)]
    outs = fresh_outputs(torch.device(DEVICE), parts)
    assert [tuple(t.shape) for t in outs] == [p[0] for p in parts]
    assert [t.dtype for t in outs] == [p[1] for p in parts]
    base = outs[0].untyped_storage().data_ptr()
    spans = []
    for t in outs:
        assert t.is_contiguous() and t.untyped_storage().data_ptr() == base  # one allocation
        if t.numel() == 0:
            continue  # an empty tensor reports data_ptr 0
        assert (t.data_ptr() - base) % PART_ALIGN == 0
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    same = fresh_outputs(torch.device(DEVICE), [((5,), torch.int32), ((4,), torch.int32)])
    assert same[0].dtype == torch.int32 and same[1].data_ptr() - same[0].data_ptr() == PART_ALIGN


def test_fresh_outputs_are_new_memory_on_every_call_with_a_remembered_layout() -> None:
    parts = [((4, 2, 8), torch.float32), ((4,), torch.int32), ((3,), torch.int32)]
    first = fresh_outputs(torch.device(DEVICE), parts)
    second = fresh_outputs(torch.device(DEVICE), [(list(shape), dtype) for shape, dtype in parts])  # lists too
    assert first[0].untyped_storage().data_ptr() != second[0].untyped_storage().data_ptr()
    for a, b in zip(first, second, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert a.data_ptr() - first[0].data_ptr() == b.data_ptr() - second[0].data_ptr()
    first[1].fill_(7)
    second[1].fill_(9)
    assert bool((first[1] == 7).all())


def test_fresh_outputs_have_torchs_contiguous_layout() -> None:
    parts = [
        ((2, 0, 3), torch.float32),
        ((4, 3), torch.bfloat16),
        ((), torch.float32),
        ((5, 1, 2), torch.float8_e4m3fn),
        ((3,), torch.int64),
    ]
    outs = fresh_outputs(torch.device(DEVICE), parts)
    for t, (shape, dtype) in zip(outs, parts):
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
        assert t.stride() == torch.empty(shape, dtype=dtype).stride()
    # Each part is its own memory: filling one leaves the others as they were.
    for i, t in enumerate(outs):
        if t.numel():
            t.reshape(-1).view(torch.uint8).fill_(i + 1)
    for i, t in enumerate(outs):
        if t.numel():
            assert bool((t.reshape(-1).view(torch.uint8) == i + 1).all()), i
    # Only empty parts, in two dtypes: still one allocation they can view.
    empty = fresh_outputs(torch.device(DEVICE), [((0,), torch.float32), ((0, 4), torch.bfloat16)])
    assert [tuple(t.shape) for t in empty] == [(0,), (0, 4)]
    assert [t.dtype for t in empty] == [torch.float32, torch.bfloat16]


def test_a_repeated_call_reuses_the_workspace_and_returns_fresh_outputs() -> None:
    w = _workload()
    config = _config()
    ws = IndexWorkspace(max_programs=3)
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16)
    first = select_blocks_triton(w.q, w.batch, stats, config=config, workspace=ws)
    buffers = [t.data_ptr() for t in (ws._energies, ws._keep_bits, ws._counts, ws._done)]
    views = ws._views[1]
    kept = (first.offsets.clone(), first.blocks[: first.nnz].clone(), first.tile_offsets.clone())
    stats_again = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16)
    second = select_blocks_triton(w.q, w.batch, stats_again, config=config, workspace=ws)
    # Scratch: the same buffers and the very same view objects (nothing allocated, nothing new created).
    assert [t.data_ptr() for t in (ws._energies, ws._keep_bits, ws._counts, ws._done)] == buffers
    assert ws._views[1] is views
    # Outputs: new memory each call, and the first call's index is untouched by the second.
    assert second.offsets.data_ptr() != first.offsets.data_ptr()
    assert stats_again.pooled_k.data_ptr() != stats.pooled_k.data_ptr()
    assert torch.equal(first.offsets, kept[0]) and torch.equal(first.blocks[: first.nnz], kept[1])
    assert torch.equal(first.tile_offsets, kept[2]) and _same_index(first, second)
    # The index's three tensors share one allocation; the statistics' five share another.
    storage = first.offsets.untyped_storage().data_ptr()
    assert first.blocks.untyped_storage().data_ptr() == storage == first.tile_offsets.untyped_storage().data_ptr()
    pooled = stats.pooled_k.untyped_storage().data_ptr()
    assert all(
        t.untyped_storage().data_ptr() == pooled
        for t in (stats.pooled_v, stats.prepared_keys.keys, stats.block_lengths, stats.block_offsets)
    )


# --------------------------------------------------------------------------- the relauncher
def test_relauncher_launches_normally_under_the_interpreter() -> None:
    if not INTERPRET:
        pytest.skip("checks the interpreter fallback")
    relaunch = launcher.Relauncher(_scan_kernel)
    counts = torch.arange(5, dtype=torch.int32)
    for _ in range(2):
        offsets = torch.zeros(6, dtype=torch.int32)
        relaunch((1,), counts, offsets, 5, SCAN=16)
        assert torch.equal(offsets, segment_offsets(counts))
    assert (relaunch.normal, relaunch.direct) == (2, 0)


# --------------------------------------------------------------------------- GPU
@gpu
@needs_cuda
def test_gpu_relaunch_matches_normal_launches_and_relaunches(monkeypatch: pytest.MonkeyPatch) -> None:
    from fpv2.index.triton import compaction, pooling

    w = planted_workload(
        [2048, 1000], [6000, 1000], num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda"
    )
    config = SelectionConfig(min_sparse_kv_len=0)
    monkeypatch.setenv(launcher.RELAUNCH_ENV, "0")
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch)
    normal = select_blocks_triton(w.q, w.batch, stats, config=config, workspace=IndexWorkspace())
    monkeypatch.delenv(launcher.RELAUNCH_ENV)
    ws = IndexWorkspace()
    launchers = (pooling._POOL, scoring._SCORE_SELECT, compaction._COMPACT)
    for _ in range(3):
        before = [r.direct for r in launchers]
        stats_r = pool_blocks_triton(w.k_cache, w.v_cache, w.batch)
        relaunched = select_blocks_triton(w.q, w.batch, stats_r, config=config, workspace=ws)
        assert torch.equal(stats_r.pooled_k, stats.pooled_k) and torch.equal(stats_r.pooled_v, stats.pooled_v)
        assert _same_index(relaunched, normal)
        assert int(ws._done) == 0
    assert all(r.direct > b for r, b in zip(launchers, before))  # the last round ran every kernel directly


@gpu
@needs_cuda
def test_gpu_fast_path_launches_two_selection_kernels_and_no_torch_op() -> None:
    w = planted_workload([4096], num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    ws = IndexWorkspace()
    config = SelectionConfig()
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch)
    select_blocks_triton(w.q, w.batch, stats, config=config, workspace=ws)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch)
        select_blocks_triton(w.q, w.batch, stats, config=config, workspace=ws)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 3, kernels  # pooling (with the keys), scoring (with the scan), compaction
    assert not any("scan" in k.lower() or "cumsum" in k.lower() or "prepare" in k for k in kernels), kernels


@pytest.mark.skipif(os.environ.get("FPV2_TRITON_RELAUNCH") == "0", reason="relaunch disabled by the environment")
def test_default_launchers_exist_for_every_kernel() -> None:
    from fpv2.index.triton import compaction, pooling

    for relaunch in (pooling._POOL, scoring._SCORE_SELECT, scoring._PREPARE, compaction._COMPACT):
        assert isinstance(relaunch, launcher.Relauncher)


# --------------------------------------------------------------------------- CUDA graph
def test_graphed_index_refuses_the_cpu() -> None:
    w = _workload()
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        GraphedIndex(w.q.cpu(), w.k_cache.cpu(), None, w.batch, config=_config())


@gpu
@needs_cuda
def test_gpu_graphed_index_replays_the_eager_index() -> None:
    w = planted_workload([4096], num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
    config = SelectionConfig()
    graphed = GraphedIndex(w.q, w.k_cache, w.v_cache, w.batch, config=config)
    for seed in range(2):
        fresh = planted_workload(
            [4096], num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda", seed=seed + 1
        )
        w.q.copy_(fresh.q)  # new inputs go into the captured tensors
        w.k_cache.copy_(fresh.k_cache)
        w.v_cache.copy_(fresh.v_cache)
        stats, index = graphed.replay()
        torch.cuda.synchronize()
        eager_stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch)
        eager = select_blocks_triton(w.q, w.batch, eager_stats, config=config, workspace=IndexWorkspace())
        assert torch.equal(stats.pooled_k, eager_stats.pooled_k) and torch.equal(stats.pooled_v, eager_stats.pooled_v)
        assert _same_index(index, eager)
        assert int(graphed.workspace._done) == 0
