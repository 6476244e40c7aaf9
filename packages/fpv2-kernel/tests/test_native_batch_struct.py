"""``paged_batch_struct`` builds a batch's fields once and caches them on the batch, without a reference cycle.

Every call returns a new struct with the same bytes as a build from scratch, keeping the batch alive;
the cache holds no reference back to anything, so dropping the batch frees it at once (no garbage
collection needed); a batch whose tensors moved (a deep copy, ``Tensor.set_``) gets its fields rebuilt.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import weakref

import pytest
import torch

from fpv2.kernel._native import structs as cs
from fpv2.kernel.contracts import PagedPrefillBatch


def _batch() -> PagedPrefillBatch:
    return PagedPrefillBatch.contiguous([5, 3, 0], [9, 3, 17], page_size=4)


def _from_scratch(batch: PagedPrefillBatch) -> bytes:
    """The struct as the binding built it on every call before the cache (field by field)."""
    struct = cs.PagedBatchStruct(
        struct_size=ctypes.sizeof(cs.PagedBatchStruct),
        num_requests=batch.num_requests,
        cu_seqlens_q=cs.tensor_desc(batch.cu_seqlens_q),
        seqlens_k=cs.tensor_desc(batch.seqlens_k),
        page_table=cs.tensor_desc(batch.page_table),
        page_size=batch.page_size,
        num_pages=batch.num_pages,
        total_q=batch.total_q,
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_k=batch.max_seqlen_k,
    )
    return bytes(struct)


@pytest.fixture
def counted_descs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the tensors ``tensor_desc`` describes from here on."""
    names: list[str] = []
    original = cs.tensor_desc

    def counting(t, name="tensor"):
        names.append(name)
        return original(t, name)

    monkeypatch.setattr(cs, "tensor_desc", counting)
    return names


def test_same_bytes_as_a_build_from_scratch_built_once_per_batch(counted_descs: list[str]) -> None:
    batch = _batch()
    expected = _from_scratch(batch)
    counted_descs.clear()
    first, second = cs.paged_batch_struct(batch), cs.paged_batch_struct(batch)
    assert bytes(first) == bytes(second) == expected
    assert first is not second
    assert counted_descs == ["batch.cu_seqlens_q", "batch.seqlens_k", "batch.page_table"]  # one build
    # A struct handed out is the caller's own: editing it leaves the cache alone.
    first.num_requests = 99
    assert bytes(cs.paged_batch_struct(batch)) == expected
    # Another batch gets its own build.
    other = _batch()
    assert bytes(cs.paged_batch_struct(other)) == _from_scratch(other)
    assert sum(name.startswith("batch.") for name in counted_descs) == 6  # (_from_scratch's are "tensor")


def test_prefill_args_reuse_the_batch_fields(counted_descs: list[str]) -> None:
    batch = _batch()
    q = torch.zeros(batch.total_q, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(batch.num_pages, batch.page_size, 2, 64, dtype=torch.bfloat16)
    for _ in range(3):
        args = cs.prefill_args_struct(q, cache, cache, torch.empty_like(q), batch)
        assert bytes(args.batch.contents) == _from_scratch(batch)
    assert counted_descs.count("batch.page_table") == 1  # one cached build
    assert counted_descs.count("q") == 3  # per-call tensors are still described per call


def test_no_reference_cycle_and_the_struct_keeps_the_batch_alive() -> None:
    was_enabled = gc.isenabled()
    gc.disable()  # only reference counting frees below: a cycle would keep the batch
    try:
        batch = _batch()
        alive = weakref.ref(batch)
        struct = cs.paged_batch_struct(batch)
        del batch
        assert alive() is not None  # the struct points into its tensors
        assert struct.cu_seqlens_q.data == alive().cu_seqlens_q.data_ptr()
        del struct
        assert alive() is None
    finally:
        if was_enabled:
            gc.enable()


def test_moved_tensors_get_their_fields_rebuilt() -> None:
    batch = _batch()
    cs.paged_batch_struct(batch)
    twin = copy.deepcopy(batch)  # copies the cache along with the batch, onto new tensors
    assert twin.page_table.data_ptr() != batch.page_table.data_ptr()
    moved = cs.paged_batch_struct(twin)
    assert moved.page_table.data == twin.page_table.data_ptr() and bytes(moved) == _from_scratch(twin)
    # Same-shape storage swapped in under the batch: the new pointer, not the cached one.
    batch.seqlens_k.set_(batch.seqlens_k.clone())
    assert cs.paged_batch_struct(batch).seqlens_k.data == batch.seqlens_k.data_ptr()
    assert bytes(cs.paged_batch_struct(batch)) == _from_scratch(batch)


def test_the_workspace_is_raw_bytes_of_any_dtype() -> None:
    # Split-KV's scratch memory (fpv2_prefill_workspace_size): a uint8 buffer is the natural one, although the
    # ABI has no uint8 tensor dtype; it must be one dense block.
    batch = _batch()
    q = torch.zeros(batch.total_q, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(batch.num_pages, batch.page_size, 2, 64, dtype=torch.bfloat16)
    workspace = torch.empty(4096, dtype=torch.uint8)
    args = cs.prefill_args_struct(q, cache, cache, torch.empty_like(q), batch, workspace=workspace)
    assert (args.workspace, args.workspace_bytes) == (workspace.data_ptr(), 4096)
    floats = torch.empty(100, dtype=torch.float32)
    assert cs.prefill_args_struct(q, cache, cache, torch.empty_like(q), batch, workspace=floats).workspace_bytes == 400
    with pytest.raises(TypeError, match="workspace must be a contiguous"):
        cs.prefill_args_struct(q, cache, cache, torch.empty_like(q), batch, workspace=workspace[::2])
