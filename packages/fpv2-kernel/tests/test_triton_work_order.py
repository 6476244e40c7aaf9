"""The Triton kernel's kept-block work order: the permutation, the automatic rule, the even-call check, and the
same output."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "the Triton kernel needs a CUDA GPU, or TRITON_INTERPRET=1 in the environment before triton is imported",
        allow_module_level=True,
    )
pytest.importorskip("triton")

from fpv2.kernel import CorrectionPlan
from fpv2.kernel.reference import pool_blocks
from fpv2.kernel.triton import BLOCK_M, sparse_attention_triton
from fpv2.kernel.triton.work_order import (
    ORDER_SEGMENTS,
    WORK_BUCKETS,
    WORK_ORDER_ENV,
    segment_work_order,
    segment_work_order_reference,
    use_work_order,
    work_buckets,
    work_order_mode,
)


def _bucket_of(stages: int) -> int:
    """work_bucket of csrc/hopper/work_order.hpp, transcribed."""
    if stages <= 0:
        return 0
    e = 0
    while stages >> (e + 1):
        e += 1
    half = (stages >> (e - 1)) & 1 if e > 0 else 0
    return min(1 + 2 * e + half, WORK_BUCKETS - 1)


def test_buckets_are_the_hopper_kernels():
    counts = torch.cat([torch.arange(0, 5000), torch.tensor([2**15 - 1, 2**15, 2**20])])
    assert work_buckets(counts).tolist() == [_bucket_of(n) for n in counts.tolist()]
    assert work_buckets(torch.tensor([1, 2, 3, 16, 23, 24, 31])).tolist() == [1, 3, 4, 9, 9, 10, 10]


def test_the_order_is_a_permutation_heaviest_bucket_first_then_last_segment_first():
    generator = torch.Generator().manual_seed(3)
    kept = torch.randint(0, 300, (1000,), generator=generator)
    kept[::97] = 1024  # a few dense-tail segments
    offsets = torch.zeros(1001, dtype=torch.int32)
    offsets[1:] = kept.cumsum(0)
    order = segment_work_order(offsets, 1000)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(1000))
    buckets = work_buckets(kept)[order.long()]
    assert (buckets[:-1] >= buckets[1:]).all(), "a lighter bucket before a heavier one"
    same = buckets[:-1] == buckets[1:]
    assert (order[:-1][same] > order[1:][same]).all(), "within a bucket: last segment first"
    assert set(order[:11].tolist()) == set(range(0, 1000, 97)), "the dense-tail segments run first"


@pytest.mark.parametrize("num_segments", [1, 2, ORDER_SEGMENTS - 1, ORDER_SEGMENTS, ORDER_SEGMENTS + 1, 1000])
@pytest.mark.parametrize("largest", [1, 5, 300, 40_000])
def test_the_order_kernel_gives_the_reference_order(device, num_segments, largest):
    # A counting sort in one launch against the argsort: every bucket size, empty segments, steps of the kernel's
    # loops cut anywhere, and a count past the last bucket.
    generator = torch.Generator().manual_seed(num_segments * 7 + largest)
    kept = torch.randint(0, largest, (num_segments,), generator=generator)
    if num_segments > 8:
        kept[::7] = 0
        kept[3] = 2**20
    offsets = _offsets(kept).to(device)
    order = segment_work_order(offsets, num_segments)
    assert order.device == offsets.device and order.dtype == torch.int32
    assert torch.equal(order.cpu(), segment_work_order_reference(offsets, num_segments).cpu())


def test_a_large_grid_is_ordered_by_the_kernels(device):
    # Many programs: each segment's place depends on the counts of every later program.
    num_segments = 40 * ORDER_SEGMENTS + 17
    kept = torch.randint(0, 3000, (num_segments,), generator=torch.Generator().manual_seed(1))
    kept[::11] = 0
    offsets = _offsets(kept).to(device)
    order = segment_work_order(offsets, num_segments)
    assert torch.equal(order.cpu(), segment_work_order_reference(offsets, num_segments).cpu())


def test_cpu_offsets_without_the_interpreter_are_ordered_by_the_reference(monkeypatch):
    from fpv2.kernel.triton import work_order

    monkeypatch.setattr(work_order, "_INTERPRETED", False)
    monkeypatch.setattr(work_order, "place_segments_kernel", None)  # would fail if launched
    kept = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(2))
    order = segment_work_order(_offsets(kept), 300)
    assert torch.equal(order, segment_work_order_reference(_offsets(kept), 300))


def test_the_order_of_no_segments_is_empty(device):
    assert segment_work_order(torch.zeros(1, dtype=torch.int32, device=device), 0).numel() == 0


def test_the_switch_is_checked(monkeypatch):
    monkeypatch.delenv(WORK_ORDER_ENV, raising=False)
    assert work_order_mode() == "auto"
    monkeypatch.setenv(WORK_ORDER_ENV, "1")
    assert work_order_mode() == "1"
    monkeypatch.setenv(WORK_ORDER_ENV, "yes")
    with pytest.raises(ValueError, match="FPV2_TRITON_WORK_ORDER=yes: expected 0 or 1"):
        work_order_mode()


def test_by_default_calls_with_more_programs_than_sms_are_ordered(monkeypatch):
    monkeypatch.delenv(WORK_ORDER_ENV, raising=False)
    cpu = torch.device("cpu")
    assert use_work_order(8, cpu)  # off CUDA any grid counts as more than one wave
    assert not use_work_order(0, cpu)
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert not use_work_order(sms, torch.device("cuda", 0))  # one wave: nothing to order
        assert use_work_order(sms + 1, torch.device("cuda", 0))
    monkeypatch.setenv(WORK_ORDER_ENV, "0")
    assert not use_work_order(8, cpu)
    monkeypatch.setenv(WORK_ORDER_ENV, "1")
    assert use_work_order(0, cpu)


def _offsets(kept: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(kept.numel() + 1, dtype=torch.int32)
    offsets[1:] = kept.cumsum(0)
    return offsets


@pytest.mark.parametrize("correction", [False, True])
def test_the_ordered_grid_writes_the_same_output(paged_case, hand_index, device, monkeypatch, correction):
    # A chunk after a cached prefix with its dense tail (the last tile keeps every visible block) and a second
    # request: the order moves programs, not work, so the output and lse are the same bit for bit; a segment left
    # out would keep its NaN poison.
    seqlens_q = [150, 70]
    case = paged_case(seqlens_q, [150, 520], num_q_heads=4, num_kv_heads=2, page_size=16, dtype=torch.float16,
                      device=device, seed=7)  # fmt: skip
    generator = torch.Generator().manual_seed(11)

    def keep(segment):
        if segment.row_end == seqlens_q[segment.request] * 2:  # the request's last tile (group 2)
            return list(segment.kept)  # the dense tail
        draws = torch.rand(len(segment.kept), generator=generator).tolist()
        return sorted(b for b, d in zip(segment.kept, draws) if d < 0.3 or b in set(segment.diagonal_band))

    index, _ = hand_index(case.batch, num_kv_heads=2, group=2, tile_size=BLOCK_M, block_size=16, keep=keep)
    plan = CorrectionPlan(pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=16)) if correction else None
    kept = (index.offsets[1:] - index.offsets[:-1])[: index.num_segments]
    order = segment_work_order(index.offsets, index.num_segments)
    assert order.tolist() != list(range(index.num_segments - 1, -1, -1)), "the order equals the reverse grid"
    assert kept[order.long()].tolist()[0] == kept.max().item()

    def run():
        out = torch.full_like(case.q, float("nan"))
        return sparse_attention_triton(
            case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, out=out, return_lse=True
        )

    monkeypatch.setenv(WORK_ORDER_ENV, "0")
    plain, plain_lse = run()
    monkeypatch.setenv(WORK_ORDER_ENV, "1")
    ordered, ordered_lse = run()
    assert torch.isfinite(ordered).all() and torch.isfinite(ordered_lse[ordered_lse > float("-inf")]).all()
    assert torch.equal(plain, ordered) and torch.equal(plain_lse, ordered_lse)


def test_the_kernel_reads_the_permutation(paged_case, hand_index, device, monkeypatch):
    # An order that runs one segment twice and another never leaves that one's rows NaN-poisoned: the grid follows
    # the permutation (the equality above alone would also hold for a kernel that ignored it).
    import fpv2.kernel.triton.launch as launch

    case = paged_case([150], [400], num_q_heads=4, num_kv_heads=2, page_size=16, dtype=torch.float16,
                      device=device, seed=5)  # fmt: skip
    index, _ = hand_index(case.batch, num_kv_heads=2, group=2, tile_size=BLOCK_M, block_size=16,
                          keep=lambda segment: list(segment.kept))  # fmt: skip

    def repeating(offsets, num_segments, **kwargs):
        order = segment_work_order(offsets, num_segments, **kwargs)
        order[-1] = order[0]
        return order

    monkeypatch.setenv(WORK_ORDER_ENV, "1")
    monkeypatch.setattr(launch, "segment_work_order", repeating)
    out = torch.full_like(case.q, float("nan"))
    sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, out=out)
    assert torch.isnan(out).any(), "every segment ran: the grid ignored the permutation"
    monkeypatch.setenv(WORK_ORDER_ENV, "0")
    out = torch.full_like(case.q, float("nan"))
    sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, out=out)
    assert torch.isfinite(out).all()
