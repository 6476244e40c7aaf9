"""bf16 copies of the pooled K/V from the pooling kernel, and the Hopper binding's use of them.

- the copies are ``pooled_k.to(torch.bfloat16)`` (and ``pooled_v``'s) bit for bit, for every cache
  dtype and page size, with and without V; the fp32 outputs do not change when they are asked for;
- the kernel's rounding helper is round-to-nearest-even on crafted bit patterns (ties, carries,
  infinities, subnormals), which the interpreter's own cast (truncation) is not;
- the binding's ``correction_plan_struct`` hands the copies over (same data pointer) while they
  describe the statistics, and converts the fp32 means again once they were modified in place.

CPU runs use the Triton interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

# The Triton index tests' shared skip rules and device (pytest applies the imported ``pytestmark``).
from test_triton_index import DEVICE, pytestmark  # noqa: E402, F401

from fpv2.index.triton import pool_blocks_triton  # noqa: E402
from fpv2.index.triton.pooling import _bf16_rne  # noqa: E402
from fpv2.index.triton.prepared_keys import PooledCopies, TritonBlockStatistics  # noqa: E402
from fpv2.kernel._native import structs as cs  # noqa: E402
from fpv2.kernel.contracts import CorrectionPlan  # noqa: E402
from fpv2.kernel.testing import planted_workload  # noqa: E402

BF16 = torch.bfloat16


def _workload(dtype: torch.dtype, page_size: int):
    return planted_workload(
        [96, 40, 1],
        [160, 40, 70],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=page_size,
        block_size=16,
        dtype=dtype,
        device=DEVICE,
        seed=3,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("with_v", [True, False], ids=["kv", "k"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_copies_are_the_bf16_conversion_of_the_pooled_means(dtype, page_size, with_v) -> None:
    w = _workload(dtype, page_size)
    v_cache = w.v_cache if with_v else None
    stats = pool_blocks_triton(w.k_cache, v_cache, w.batch, block_size=16, pooled_copy_dtype=BF16)
    assert isinstance(stats, TritonBlockStatistics)
    copies = stats.pooled_copies
    assert isinstance(copies, PooledCopies) and copies.dtype == BF16
    assert copies.k.is_contiguous() and torch.equal(_bits(copies.k), _bits(stats.pooled_k.to(BF16)))
    if with_v:
        assert copies.v.is_contiguous() and torch.equal(_bits(copies.v), _bits(stats.pooled_v.to(BF16)))
    else:
        assert copies.v is None
    # One allocation for every output, the copies included.
    base = stats.pooled_k.untyped_storage().data_ptr()
    assert copies.k.untyped_storage().data_ptr() == base
    # Asking for them changes none of the other outputs; the default makes none.
    plain = pool_blocks_triton(w.k_cache, v_cache, w.batch, block_size=16)
    assert plain.pooled_copies is None and plain.pooled_in(BF16) is None
    assert torch.equal(plain.pooled_k, stats.pooled_k)
    assert torch.equal(plain.block_lengths, stats.block_lengths)
    assert torch.equal(plain.block_offsets, stats.block_offsets)
    assert torch.equal(plain.prepared_keys.keys, stats.prepared_keys.keys)
    if with_v:
        assert torch.equal(plain.pooled_v, stats.pooled_v)


def test_fp8_copies_are_the_bf16_conversion_of_the_dequantised_means() -> None:
    w = _workload(torch.float32, 16)
    k8 = w.k_cache.clamp(-200, 200).to(torch.float8_e4m3fn)
    v8 = w.v_cache.clamp(-200, 200).to(torch.float8_e4m3fn)
    k_ds = torch.rand(3, 2, device=DEVICE) + 0.5
    v_ds = torch.rand(3, 2, device=DEVICE) + 0.5
    stats = pool_blocks_triton(k8, v8, w.batch, block_size=16, k_descale=k_ds, v_descale=v_ds, pooled_copy_dtype=BF16)
    assert torch.equal(_bits(stats.pooled_copies.k), _bits(stats.pooled_k.to(BF16)))
    assert torch.equal(_bits(stats.pooled_copies.v), _bits(stats.pooled_v.to(BF16)))


def test_only_bf16_copies_are_offered() -> None:
    w = _workload(torch.float16, 16)
    with pytest.raises(TypeError, match="pooled_copy_dtype must be torch.bfloat16 or None"):
        pool_blocks_triton(w.k_cache, None, w.batch, block_size=16, pooled_copy_dtype=torch.float16)


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, _bf16_rne(tl.load(x_ptr + offs, mask=ok, other=0.0)), mask=ok)


def test_rounding_helper_is_round_to_nearest_even() -> None:
    patterns = [
        0x3F800000,  # 1.0
        0x3F808000,  # 1 + half an ulp: a tie, stays on the even 1.0
        0x3F818000,  # a tie above an odd mantissa: rounds up to even
        0x3F808001,  # just above a tie: rounds up
        0x3F807FFF,  # just below a tie: rounds down
        0x3FFFFFFF,  # mantissa carry into the exponent: 2.0
        0xBF818000,  # negative tie
        0x7F7FFFFF,  # the largest float: rounds past the largest bf16, to inf
        0x7F7F7FFF,  # stays finite
        0x7F800000,  # inf
        0xFF800000,  # -inf
        0x00000001,  # smallest subnormal: rounds to zero
        0x00008000,  # a subnormal tie: stays on the even zero
        0x00018000,  # a subnormal tie above an odd mantissa: rounds up
        0x007FFFFF,  # largest subnormal: rounds up to the smallest normal
        0x80000000,  # -0.0
        0x12345678,
        0xC0490FDB,  # -pi
    ]
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32).to(DEVICE)
    nan = torch.tensor([float("nan")], device=DEVICE)
    x = torch.cat([x, nan])
    out = torch.empty(x.shape, dtype=BF16, device=DEVICE)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=32)
    assert torch.equal(_bits(out[:-1]).cpu(), _bits(x[:-1].to(BF16)).cpu())
    assert int(_bits(out[-1:]).cpu()) == 0x7FFF  # the GPU's canonical NaN


def _plan(stats: TritonBlockStatistics) -> CorrectionPlan:
    return CorrectionPlan(stats)


def test_correction_plan_struct_hands_the_copies_over_while_they_are_current() -> None:
    w = _workload(torch.bfloat16, 16)
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16, pooled_copy_dtype=BF16)
    copies = stats.pooled_copies
    struct = cs.correction_plan_struct(_plan(stats), pooled_dtype=BF16)
    assert struct.pooled_k.data == copies.k.data_ptr() and struct.pooled_v.data == copies.v.data_ptr()
    assert struct.pooled_k.dtype == struct.pooled_v.dtype == cs.DType.BF16
    # Same descriptors as the conversion they replace.
    converted = cs.tensor_desc(stats.pooled_k.to(BF16))
    assert list(struct.pooled_k.shape) == list(converted.shape)
    assert list(struct.pooled_k.strides) == list(converted.strides)
    # Without a dtype the fp32 means go over as they are.
    fp32 = cs.correction_plan_struct(_plan(stats))
    assert fp32.pooled_k.data == stats.pooled_k.data_ptr() and fp32.pooled_k.dtype == cs.DType.F32

    # An in-place edit of pooled_k (a version bump) retires the copies: the binding converts again.
    stats.pooled_k.mul_(2.0)
    assert stats.pooled_in(BF16) is None
    fallback_plan = _plan(stats)
    fallback = cs.correction_plan_struct(fallback_plan, pooled_dtype=BF16)
    assert fallback.pooled_k.data not in (copies.k.data_ptr(), stats.pooled_k.data_ptr())
    assert fallback.pooled_v.data != copies.v.data_ptr()
    kept_k = fallback._fpv2_keepalive[1]  # the converted copy the struct keeps alive
    assert kept_k.data_ptr() == fallback.pooled_k.data and torch.equal(kept_k, stats.pooled_k.to(BF16))


def test_an_edit_of_pooled_v_alone_retires_the_copies_too() -> None:
    w = _workload(torch.float16, 1)
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16, pooled_copy_dtype=BF16)
    assert stats.pooled_in(BF16) is not None
    assert stats.pooled_in(torch.float16) is None  # copies of another dtype are not offered
    stats.pooled_v[0].zero_()
    assert stats.pooled_in(BF16) is None
    struct = cs.correction_plan_struct(_plan(stats), pooled_dtype=BF16)
    assert struct.pooled_v.data != stats.pooled_copies.v.data_ptr()


def test_under_inference_mode_the_statistics_keep_their_version_checks() -> None:
    # Engines (vLLM) run the forward pass under torch.inference_mode, whose tensors keep no version counter:
    # pooling there used to fail reading pooled_k._version. The outputs are made as normal tensors instead.
    w = _workload(torch.bfloat16, 1)
    with torch.inference_mode():
        stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16, pooled_copy_dtype=BF16)
        assert not stats.pooled_k.is_inference() and not stats.pooled_v.is_inference()
        assert stats.pooled_in(BF16) is not None
        stats.pooled_v[0].zero_()  # an edit inside inference mode is still seen
        assert stats.pooled_in(BF16) is None
    outside = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16, pooled_copy_dtype=BF16)
    with torch.inference_mode():
        again = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=16, pooled_copy_dtype=BF16)
    torch.testing.assert_close(again.pooled_k, outside.pooled_k, rtol=0, atol=0)


def test_records_of_inference_tensors_never_match() -> None:
    with torch.inference_mode():
        k = torch.zeros(4, 2, 8, device=DEVICE)
        v = torch.zeros(4, 2, 8, device=DEVICE)
    assert k.is_inference()
    copies = PooledCopies.of(k.to(BF16), v.to(BF16), k, v)
    assert copies.k_version is None and not copies.matches(k, v)  # no counter: an edit could not be seen
    normal = torch.zeros(4, 2, 8, device=DEVICE)
    assert PooledCopies.of(normal.to(BF16), None, normal, None).matches(normal, None)
