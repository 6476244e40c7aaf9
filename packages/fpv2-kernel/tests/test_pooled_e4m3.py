"""E4M3 copies of the pooled statistics: the Triton kernel against the reference, the slot order, the binding switch.

On CPU machines the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1`` before ``triton`` is
first imported, as the nox ``tests`` session sets it); without it, and without a GPU, only the reference
and slot tests run. The reference is checked on its own (dequantisation error, padding, slots against the
``FPV2_E4M3_SLOT`` macro compiled from ``fpv2.h``), then the kernel bit for bit against it.
"""

from __future__ import annotations

import ctypes
import shutil
import zlib

import pytest
import torch

from fpv2.kernel import BlockStatistics, CorrectionPlan
from fpv2.kernel.reference.pooled_e4m3 import (
    PooledE4M3,
    dequantize_pooled_e4m3,
    e4m3_rows,
    e4m3_slot,
    quantize_pooled_e4m3_reference,
)

try:
    from fpv2.kernel.triton.pooled_e4m3 import is_interpreted, quantize_pooled_e4m3
except ImportError:  # pragma: no cover - triton is an extra
    quantize_pooled_e4m3 = None
INTERPRETED = quantize_pooled_e4m3 is not None and is_interpreted()
#: Where the kernel runs here: the CPU under the interpreter, else a CUDA device (None: nowhere).
KERNEL_DEVICE = "cpu" if INTERPRETED else "cuda" if quantize_pooled_e4m3 and torch.cuda.is_available() else None
needs_kernel = pytest.mark.skipif(
    KERNEL_DEVICE is None, reason="needs Triton and a CUDA GPU, or TRITON_INTERPRET=1 before triton is imported"
)

#: Ragged block counts: empty requests, a lone block, one short of, exactly and one past a group, several groups.
BATCHES = [(40,), (0, 1, 17), (15, 16, 0), (0,)]
E4M3 = torch.float8_e4m3fn


def _inputs(
    counts: tuple[int, ...], num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random pooled K/V whose rows span five decades (subnormal e4m3 codes appear), and their block offsets."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(counts)
    magnitude = 10.0 ** torch.empty(total, num_kv_heads, 1).uniform_(-4, 1, generator=gen)
    pooled_k = (torch.randn(total, num_kv_heads, head_dim, generator=gen) * magnitude).to(dtype)
    pooled_v = (torch.randn(total, num_kv_heads, head_dim, generator=gen) * magnitude.flip(0) * 0.1).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return pooled_k.to(device), pooled_v.to(device), offsets.to(device)


def _assert_bit_equal(got: PooledE4M3, want: PooledE4M3) -> None:
    for name in ("k", "vt", "offsets", "scales"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, name
        if a.dtype == E4M3:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        elif a.dtype == torch.float32:
            a, b = a.view(torch.int32), b.view(torch.int32)
        mismatch = (a != b).nonzero()
        assert mismatch.numel() == 0, f"{name}: {mismatch.shape[0]} elements differ, first at {mismatch[:4].tolist()}"


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` returns 0xFF bytes (NaN in e4m3, -1 in int32) while the test runs: unwritten output shows."""
    real_empty = torch.empty

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        if t.numel() and t.is_contiguous():
            t.view(torch.uint8).fill_(0xFF)
        return t

    monkeypatch.setattr(torch, "empty", empty)


# --------------------------------------------------------------------------------------------- slots
def _slot_as_in_the_brief(j: int) -> int:
    """``FPV2_E4M3_SLOT`` as fpv2.h words it, transcribed (the C compiler checks the macro itself below)."""
    r = j & 15
    s = 4 * (r >> 1) + (j & 1) if r < 8 else 4 * ((r - 8) >> 1) + 2 + (j & 1)
    return (j & ~15) + s


def test_slot_is_a_permutation_of_each_group_and_matches_the_formula() -> None:
    slots = [e4m3_slot(j) for j in range(64)]
    assert slots == [_slot_as_in_the_brief(j) for j in range(64)]
    for g in range(4):
        assert sorted(slots[16 * g : 16 * (g + 1)]) == list(range(16 * g, 16 * (g + 1)))
    # slot 4t + i holds block 2t + i (i < 2) or 8 + 2t + i - 2 (i >= 2)
    inverse = {s: j for j, s in enumerate(slots[:16])}
    assert [inverse[4 * t + i] for t in range(4) for i in range(4)] == [
        2 * t + i if i < 2 else 8 + 2 * t + i - 2 for t in range(4) for i in range(4)
    ]
    assert e4m3_slot(torch.arange(64, dtype=torch.int32)).tolist() == slots
    with pytest.raises(ValueError, match="block index >= 0"):
        e4m3_slot(-1)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on PATH")
def test_slot_matches_the_header_macro(run_against_header) -> None:
    printed = run_against_header(
        '#include <stdio.h>\n#include "fpv2/fpv2.h"\n'
        'int main(void) { for (int j = 0; j < 64; ++j) printf("%d\\n", FPV2_E4M3_SLOT(j)); return 0; }\n'
    )
    assert [int(x) for x in printed.split()] == [e4m3_slot(j) for j in range(64)]


# --------------------------------------------------------------------------------------------- reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_layout_padding_and_precision(dtype: torch.dtype) -> None:
    counts, hkv, d = (0, 1, 17, 40), 2, 64
    pooled_k, pooled_v, block_offsets = _inputs(counts, hkv, d, dtype, seed=1)
    out = quantize_pooled_e4m3_reference(pooled_k, pooled_v, block_offsets)
    rows = e4m3_rows(sum(counts), len(counts))
    assert rows == 16 * -(-(58 + 15 * 4) // 16) == 128
    assert out.k.shape == (rows, hkv, d) and out.vt.shape == (hkv, d, rows) and out.vt.is_contiguous()
    assert out.k.dtype == out.vt.dtype == E4M3 and out.scales.shape == (4, hkv, 2)
    assert out.offsets.dtype == torch.int32 and out.offsets.tolist() == [0, 0, 16, 48, 96]
    assert out.scales[0].eq(1.0).all()  # a request without blocks
    # Every row or column outside a request's blocks is zero (the padding and the tail past offsets[B]).
    used_rows, used_columns = torch.zeros(rows, dtype=torch.bool), torch.zeros(rows, dtype=torch.bool)
    for b, n in enumerate(counts):
        used_rows[out.offsets[b] : out.offsets[b] + n] = True
        used_columns[out.offsets[b] + e4m3_slot(torch.arange(n))] = True
    assert (out.k.view(torch.uint8)[~used_rows] == 0).all()
    assert (out.vt.view(torch.uint8)[:, :, ~used_columns] == 0).all()
    # The 40-block request starts at row 48: its last 8 blocks fill slots 0, 1, 4, 5, 8, 9, 12, 13 of rows 80..95.
    assert used_columns[80:96].nonzero().flatten().tolist() == [0, 1, 4, 5, 8, 9, 12, 13]
    # e4m3 * scale, read back through the slots, is the input within e4m3's half-ulp (2^-4 relative,
    # 2^-10 of the scale in the subnormal range; the bound allows 2^-9).
    deq_k, deq_v = dequantize_pooled_e4m3(out, block_offsets)
    for b, n in enumerate(counts):
        start = int(block_offsets[b])
        for which, (x, deq) in enumerate(((pooled_k, deq_k), (pooled_v, deq_v))):
            x_b, deq_b = x[start : start + n].float(), deq[start : start + n]
            scale = out.scales[b, :, which][None, :, None]
            bound = torch.maximum(x_b.abs() * 2.0**-4, scale * 2.0**-9)
            assert ((deq_b - x_b).abs() <= bound).all(), (b, which)
            if n:  # the largest magnitude maps onto 448 exactly
                assert torch.allclose(x_b.abs().amax(dim=(0, 2)), out.scales[b, :, which] * 448.0, rtol=1e-6)


# --------------------------------------------------------------------------------------------- kernel
@needs_kernel
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("counts", BATCHES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference_bitwise(
    counts: tuple[int, ...], num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    seed = zlib.crc32(repr((counts, num_kv_heads, head_dim, dtype)).encode())
    pooled_k, pooled_v, block_offsets = _inputs(counts, num_kv_heads, head_dim, dtype, seed, KERNEL_DEVICE)
    _assert_bit_equal(
        quantize_pooled_e4m3(pooled_k, pooled_v, block_offsets),
        quantize_pooled_e4m3_reference(pooled_k, pooled_v, block_offsets),
    )


@needs_kernel
@pytest.mark.usefixtures("poisoned_outputs")
def test_kernel_with_more_requests_than_one_offset_step_and_an_odd_head_dim() -> None:
    # 70 requests: a program sums the padded counts before it in steps of 64 requests; d = 96 masks features.
    counts = tuple((7 * b) % 20 for b in range(70))
    pooled_k, pooled_v, block_offsets = _inputs(counts, 1, 96, torch.bfloat16, seed=9, device=KERNEL_DEVICE)
    _assert_bit_equal(
        quantize_pooled_e4m3(pooled_k, pooled_v, block_offsets),
        quantize_pooled_e4m3_reference(pooled_k, pooled_v, block_offsets),
    )


#: Request 0 of the tie case: amax 448 (scale exactly 1), ties to even, subnormal ties, signed zeros.
TIES = [448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, -(2.0**-11), -0.0, 432.0, 7.92, 31.8]
#: Their e4m3 codes: 448, 1.0 and 1.25 (even), -1.0, 0 and 2^-8 (even), -0, -0, 448 (even), 8, 32.
TIE_CODES = [0x7E, 0x38, 0x3A, 0xB8, 0x00, 0x02, 0x80, 0x80, 0x7E, 0x50, 0x60]


def _ties_and_zeros(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request 0: three blocks of the tie values (V mirrored); request 1: two blocks of zeros (scale 1)."""
    row = torch.zeros(64)
    row[: len(TIES)] = torch.tensor(TIES)
    pooled_k = torch.cat([row.expand(3, 1, 64), torch.zeros(2, 1, 64)])
    pooled_v = pooled_k.flip(-1).contiguous()
    return pooled_k.to(device), pooled_v.to(device), torch.tensor([0, 3, 5], dtype=torch.int32, device=device)


def test_reference_rounds_ties_to_even_and_keeps_signed_zeros() -> None:
    out = quantize_pooled_e4m3_reference(*_ties_and_zeros("cpu"))
    assert out.scales.flatten().tolist() == [1.0] * 4
    assert out.k.view(torch.uint8)[:3, 0, : len(TIES)].tolist() == [TIE_CODES] * 3
    slots = [e4m3_slot(j) for j in range(3)]
    assert out.vt.view(torch.uint8)[0, -len(TIES) :, slots].flip(0).T.tolist() == [TIE_CODES] * 3
    assert (out.k.view(torch.uint8)[16:] == 0).all() and out.offsets.tolist() == [0, 16, 32]


@needs_kernel
@pytest.mark.usefixtures("poisoned_outputs")
def test_kernel_rounds_like_the_reference_on_ties_signed_zeros_and_zero_requests() -> None:
    pooled_k, pooled_v, block_offsets = _ties_and_zeros(KERNEL_DEVICE)
    out = quantize_pooled_e4m3(pooled_k, pooled_v, block_offsets)
    _assert_bit_equal(out, quantize_pooled_e4m3_reference(pooled_k, pooled_v, block_offsets))
    # A scale that is not 1 (amax 460): the division's rounding must match too.
    pooled_k[1, 0, 20] = -460.0
    _assert_bit_equal(
        quantize_pooled_e4m3(pooled_k, pooled_v, block_offsets),
        quantize_pooled_e4m3_reference(pooled_k, pooled_v, block_offsets),
    )


BAD_INPUTS = [
    ("pooled_k", TypeError, lambda k, v, o: (k.half(), v, o)),
    ("pooled_v", TypeError, lambda k, v, o: (k, v.bfloat16(), o)),
    ("pooled_v", ValueError, lambda k, v, o: (k, v[:-1], o)),
    ("pooled_k", ValueError, lambda k, v, o: (k[:, :, None], v, o)),
    ("pooled_k", ValueError, lambda k, v, o: (k.transpose(0, 1).contiguous().transpose(0, 1), v, o)),
    ("block_offsets", TypeError, lambda k, v, o: (k, v, o.long())),
    ("block_offsets", ValueError, lambda k, v, o: (k, v, o[:1])),
    ("block_offsets", ValueError, lambda k, v, o: (k, v, o[None])),
    ("pooled_k", TypeError, lambda k, v, o: (k.tolist(), v, o)),
]


@pytest.mark.parametrize(
    ("name", "exc", "mutate"), BAD_INPUTS, ids=[f"{n}-{e.__name__}-{i}" for i, (n, e, _) in enumerate(BAD_INPUTS)]
)
def test_bad_inputs_are_refused_by_name(name: str, exc: type[Exception], mutate) -> None:
    pooled_k, pooled_v, block_offsets = _inputs((3, 5), 2, 64, torch.float32, seed=0)
    args = mutate(pooled_k, pooled_v, block_offsets)
    functions = [quantize_pooled_e4m3_reference] + ([quantize_pooled_e4m3] if quantize_pooled_e4m3 else [])
    for function in functions:
        with pytest.raises(exc, match=name):
            function(*args)


@pytest.mark.skipif(quantize_pooled_e4m3 is None or INTERPRETED, reason="needs Triton, compiled")
def test_cpu_tensors_without_the_interpreter_are_refused() -> None:
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        quantize_pooled_e4m3(*_inputs((3,), 1, 64, torch.float32, seed=0))


@pytest.mark.gpu
@pytest.mark.skipif(quantize_pooled_e4m3 is None or INTERPRETED, reason="needs Triton compiled for the GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_kernel_matches_reference_without_a_sync(dtype: torch.dtype) -> None:
    counts = (0, 1, 15, 16, 17, 300, 1024)
    pooled_k, pooled_v, block_offsets = _inputs(counts, 8, 128, dtype, seed=3, device="cuda")
    quantize_pooled_e4m3(pooled_k, pooled_v, block_offsets)  # compile outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = quantize_pooled_e4m3(pooled_k, pooled_v, block_offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_bit_equal(got, quantize_pooled_e4m3_reference(pooled_k, pooled_v, block_offsets))
    pooled_k, pooled_v, block_offsets = _ties_and_zeros("cuda")
    _assert_bit_equal(
        quantize_pooled_e4m3(pooled_k, pooled_v, block_offsets),
        quantize_pooled_e4m3_reference(pooled_k, pooled_v, block_offsets),
    )


# --------------------------------------------------------------------------------------------- binding switch
class _FakeLibrary:
    """Stands in for libfpv2_kernel: records the correction plan of each ``fpv2_prefill`` call, and its K copy."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, bytes]] = []

    def fpv2_prefill(self, args_ref: object) -> int:
        plan = args_ref._obj.correction.contents  # type: ignore[attr-defined]
        k8 = ctypes.string_at(plan.pooled_k_e4m3.data, 2 * 64) if plan.pooled_k_e4m3.data else b""
        self.calls.append((plan, k8))
        return 0


@needs_kernel
@pytest.mark.parametrize(
    ("env", "explicit", "page_size", "e4m3"),
    [
        (None, None, 128, False),  # off by default
        ("1", None, 128, True),
        ("true", None, 256, False),  # only "1" switches it on
        ("1", None, 64, False),  # the gather path keeps the bf16 copies
        ("1", False, 128, False),
        (None, True, 256, True),
        (None, True, 16, False),
    ],
)
def test_hopper_prefill_hands_over_e4m3_copies_when_switched_on(
    monkeypatch: pytest.MonkeyPatch, env: str | None, explicit: bool | None, page_size: int, e4m3: bool
) -> None:
    from fpv2.kernel._native import DType, api
    from fpv2.kernel.contracts import PagedPrefillBatch

    fake = _FakeLibrary()
    monkeypatch.setattr(api, "load_native_library", lambda: fake)
    if env is None:
        monkeypatch.delenv(api.POOLED_E4M3_ENV, raising=False)
    else:
        monkeypatch.setenv(api.POOLED_E4M3_ENV, env)
    batch = PagedPrefillBatch.contiguous([130], [130], page_size=page_size)
    cache = torch.zeros(batch.num_pages, page_size, 1, 64, dtype=torch.bfloat16)
    pooled_k, pooled_v, block_offsets = _inputs((2,), 1, 64, torch.float32, seed=0)
    stats = BlockStatistics(pooled_k, pooled_v, torch.tensor([128, 2], dtype=torch.int32), block_offsets)
    q = torch.zeros(130, 1, 64, dtype=torch.bfloat16)
    api.hopper_prefill(q, cache, cache, q.clone(), batch, plan=CorrectionPlan(stats), pooled_e4m3=explicit)
    ((plan, k8),) = fake.calls
    if e4m3:
        assert plan.pooled_k.dtype == DType.F32 and plan.pooled_k.data == pooled_k.data_ptr()  # not converted
        assert plan.pooled_k_e4m3.dtype == plan.pooled_vt_e4m3.dtype == DType.E4M3
        assert list(plan.pooled_vt_e4m3.shape)[:3] == [1, 64, e4m3_rows(2, 1)]
        assert plan.e4m3_offsets.dtype == DType.I32 and plan.e4m3_scales.dtype == DType.F32
        want = quantize_pooled_e4m3_reference(pooled_k, pooled_v, block_offsets).k.view(torch.uint8)[:2]
        assert k8 == want.numpy().tobytes()
    else:
        assert plan.pooled_k.dtype == plan.pooled_v.dtype == DType.BF16
        for name in ("pooled_k_e4m3", "pooled_vt_e4m3", "e4m3_offsets", "e4m3_scales"):
            field = getattr(plan, name)
            assert field.data is None and field.ndim == 0, name
