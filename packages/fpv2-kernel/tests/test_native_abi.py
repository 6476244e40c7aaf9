"""The C ABI of libfpv2_kernel: version handshake, struct layout, validation messages, exports.

CPU only: validation reads metadata, never tensor data, so CPU tensors stand in for device ones.

Run against a library you built, e.g. from the repository root::

    cmake -S . -B build -G Ninja && cmake --build build
    FPV2_KERNEL_LIBRARY=build/packages/fpv2-kernel/libfpv2_kernel.so \\
        PYTHONPATH=packages/fpv2-kernel/src pytest packages/fpv2-kernel/tests/test_native_abi.py

Without ``FPV2_KERNEL_LIBRARY`` the copy installed in the wheel (``fpv2/kernel/lib``) is used.
The tests that call the library (``needs_library``) are skipped when none is found or it speaks an
older ABI than the binding (build it from the same tree), unless ``FPV2_REQUIRE_NATIVE=1``; the
checks of the header against the ctypes mirrors and of the struct builders run without it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
import re
import shutil
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from fpv2.kernel import _native as native
from fpv2.kernel._native import structs as cs
from fpv2.kernel.contracts import (
    CORRECTION_CHUNK,
    SUPPORTED_HEAD_DIMS,
    TILE_SIZE,
    BlockIndex,
    CorrectionPlan,
    KeySpread,
    PagedPrefillBatch,
    expected_tile_offsets,
    num_key_blocks,
    num_query_tiles,
    tile_span,
)
from fpv2.kernel.reference.correction_rule import todo_words
from fpv2.kernel.reference.pooled_e4m3 import PooledE4M3, quantize_pooled_e4m3_reference
from fpv2.kernel.reference.pooling import pool_blocks

try:
    LIB = native.load_native_library()
    LIB_PATH = native.library_path()
    NO_LIBRARY = ""
except native.NativeLibraryError as _exc:
    if os.environ.get("FPV2_REQUIRE_NATIVE") == "1":
        pytest.fail(f"FPV2_REQUIRE_NATIVE=1 but libfpv2_kernel is unusable: {_exc}", pytrace=False)
    LIB, LIB_PATH = None, None
    NO_LIBRARY = f"libfpv2_kernel not available ({_exc}); build it and set FPV2_KERNEL_LIBRARY to run this test"
#: Marks the tests that call into the library.
needs_library = pytest.mark.skipif(LIB is None, reason=NO_LIBRARY)

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
IN_TREE_HEADER = PACKAGE_ROOT / "include" / "fpv2" / "fpv2.h"
INSTALLED_HEADER = LIB_PATH.resolve().parent.parent / "include" / "fpv2" / "fpv2.h" if LIB_PATH else None
CHECK_SYMBOLS = PACKAGE_ROOT / "tools" / "check_symbols.py"
HEADERS = [h for h in (IN_TREE_HEADER, INSTALLED_HEADER) if h is not None and h.is_file()]
Status = native.Status
DType = native.DType
HAS_KERNEL = LIB is not None and bool(LIB.fpv2_hopper_kernel_available())
#: Head dims with a compiled Hopper instantiation (from the build description; () without the kernel).
BUILT_HEAD_DIMS = native.hopper_head_dims()


def _last_error() -> str:
    return LIB.fpv2_get_last_error().decode()


def _defines(header: Path) -> dict[str, int]:
    """Integer ``#define``s and enumerators of a header, parsed from its text."""
    text = header.read_text()
    values = {m[0]: int(m[1]) for m in re.findall(r"^#define\s+(FPV2_\w+)\s+(\d+)u?\s*$", text, re.MULTILINE)}
    values.update({m[0]: int(m[1]) for m in re.findall(r"^\s*(FPV2_\w+)\s*=\s*(\d+)\s*,?", text, re.MULTILINE)})
    return values


# --------------------------------------------------------------------------------------------- workload
@dataclass
class Case:
    """A small valid prefill problem with a sparse index and a correction plan (CPU tensors)."""

    dtype: torch.dtype = torch.bfloat16
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    seqlens_q: tuple[int, ...] = (100, 37)
    seqlens_k: tuple[int, ...] = (600, 37)
    batch: PagedPrefillBatch = field(init=False)
    q: torch.Tensor = field(init=False)
    k_cache: torch.Tensor = field(init=False)
    v_cache: torch.Tensor = field(init=False)
    out: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.batch = PagedPrefillBatch.contiguous(list(self.seqlens_q), list(self.seqlens_k), page_size=self.page_size)
        total_q, pages = sum(self.seqlens_q), self.batch.num_pages
        cache_shape = (pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.q = torch.randn(total_q, self.num_q_heads, self.head_dim, generator=gen).to(self.dtype)
        self.k_cache = torch.randn(*cache_shape, generator=gen).to(self.dtype)
        self.v_cache = torch.randn(*cache_shape, generator=gen).to(self.dtype)
        out_dtype = torch.bfloat16 if self.dtype == torch.float8_e4m3fn else self.dtype
        self.out = torch.empty(total_q, self.num_q_heads, self.head_dim, dtype=out_dtype)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def descales(self) -> dict[str, torch.Tensor]:
        shape = (self.batch.num_requests, self.num_kv_heads)
        return {f"{n}_descale": torch.full(shape, 0.5) for n in "qkv"}

    def index_and_plan(self) -> tuple[BlockIndex, CorrectionPlan]:
        """Keep block 0 and the diagonal band of every tile; todo words for the rest."""
        host = self.batch.host
        nblocks = max(num_key_blocks(k) for k in host.seqlens_k)
        rows, words, todo_offsets = [], [], [0]
        for q_len, prefix in zip(host.q_lens, host.prefix):
            for _ in range(self.num_kv_heads):
                for t in range(num_query_tiles(q_len, self.group)):
                    span = tile_span(t, q_len, prefix, self.group)
                    kept = sorted({0, *range(span.first_diagonal_block, span.last_visible_block + 1)})
                    row = torch.zeros(nblocks, dtype=torch.bool)
                    row[kept] = True
                    rows.append(row)
                    words += todo_words(kept, span)
                    todo_offsets.append(len(words))
        index = BlockIndex.from_dense_mask(
            torch.stack(rows),
            expected_tile_offsets(self.batch, self.group),
            num_kv_heads=self.num_kv_heads,
            group=self.group,
        )
        index.check_compatible(self.batch, self.group, tile_size=TILE_SIZE)  # the Python contract agrees
        plan = CorrectionPlan(
            pool_blocks(self.k_cache, self.v_cache, self.batch),
            todo_offsets=torch.tensor(todo_offsets, dtype=torch.int32),
            todo_masks=torch.tensor(words, dtype=torch.int64),
        )
        return index, plan

    def args(self, **kwargs: object) -> cs.PrefillArgsStruct:
        values = {"q": self.q, "k_cache": self.k_cache, "v_cache": self.v_cache, "out": self.out}
        values.update({k: kwargs.pop(k) for k in list(kwargs) if k in values})
        if self.dtype == torch.float8_e4m3fn and "q_descale" not in kwargs:
            kwargs.update(self.descales())
        return cs.prefill_args_struct(
            values["q"], values["k_cache"], values["v_cache"], values["out"], self.batch, **kwargs
        )


def _validate(args: cs.PrefillArgsStruct) -> int:
    return LIB.fpv2_validate_prefill(ctypes.byref(args))


# --------------------------------------------------------------------------------------------- handshake
@needs_library
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: "installed" if h == INSTALLED_HEADER else "in-tree")
def test_abi_version_matches_header(header: Path) -> None:
    defines = _defines(header)
    expected = (defines["FPV2_ABI_VERSION_MAJOR"], defines["FPV2_ABI_VERSION_MINOR"])
    assert native.abi_version() == expected
    assert (native.ABI_VERSION_MAJOR, native.ABI_VERSION_MINOR) == expected
    major, minor = ctypes.c_int32(-1), ctypes.c_int32(-1)
    LIB.fpv2_get_abi_version(ctypes.byref(major), ctypes.byref(minor))
    assert (major.value, minor.value) == expected
    LIB.fpv2_get_abi_version(None, None)  # NULL outputs are allowed


@pytest.mark.parametrize("header", HEADERS, ids=lambda h: "installed" if h == INSTALLED_HEADER else "in-tree")
def test_codes_match_header(header: Path) -> None:
    defines = _defines(header)
    for status in Status:
        name = "FPV2_OK" if status == Status.OK else f"FPV2_ERROR_{status.name}"
        assert defines[name] == status, name
    for dtype in native.DType:
        assert defines[f"FPV2_DTYPE_{dtype.name}"] == dtype
    assert defines["FPV2_PREFILL_CAUSAL"] == native.PREFILL_CAUSAL
    assert defines["FPV2_MAX_NDIM"] == native.MAX_NDIM
    assert defines["FPV2_KERNEL_TILE_SIZE"] == native.KERNEL_TILE_SIZE == TILE_SIZE
    assert defines["FPV2_CORRECTION_CHUNK"] == native.CORRECTION_CHUNK == CORRECTION_CHUNK


@pytest.mark.parametrize(
    ("found", "expected", "fragment"),
    [
        ((2, 0), (1, 0), "ABI 2.0"),
        ((0, 7), (1, 0), "ABI 0.7"),
        ((1, 2), (1, 3), "older than the ABI 1.3"),
    ],
)
def test_abi_mismatch_is_refused(found: tuple[int, int], expected: tuple[int, int], fragment: str) -> None:
    with pytest.raises(native.NativeLibraryError) as info:
        native.check_abi_version(found, "/opt/x/libfpv2_kernel.so", expected)
    message = str(info.value)
    assert fragment in message
    assert f"{expected[0]}." in message and "/opt/x/libfpv2_kernel.so" in message


def test_newer_minor_is_accepted() -> None:
    native.check_abi_version((1, 5), "lib.so", (1, 0))
    native.check_abi_version((1, 0), "lib.so", (1, 0))


@needs_library
def test_build_info_and_status_strings() -> None:
    info = LIB.fpv2_get_build_info().decode()
    assert "nvcc" in info and "sm_90a" in info and "CUTLASS 4.2" in info
    assert ("Hopper attention kernel: built" in info) == HAS_KERNEL
    assert ("not built" in info) == (not HAS_KERNEL)
    if HAS_KERNEL:
        # The build names its head dims, a non-empty subset of what the contracts accept.
        assert BUILT_HEAD_DIMS and set(BUILT_HEAD_DIMS) <= set(SUPPORTED_HEAD_DIMS)
        assert f"head dims {', '.join(map(str, BUILT_HEAD_DIMS))};" in info
    else:
        assert BUILT_HEAD_DIMS == ()
    for status in Status:
        text = LIB.fpv2_status_string(status).decode()
        assert text.startswith("FPV2_OK" if status == Status.OK else f"FPV2_ERROR_{status.name}")
    assert "unknown" in LIB.fpv2_status_string(1234).decode()


# --------------------------------------------------------------------------------------------- layout
def test_struct_layout_matches_c_compiler(run_against_header) -> None:
    """sizeof/offsetof of every field, from C99 (-pedantic) and C++ compilers, equal the ctypes mirrors."""
    classes = (cs.TensorDesc, *cs.SIZED_STRUCTS)
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "fpv2/fpv2.h"', "int main(void) {"]
    expected = []
    for cls in classes:
        lines.append(f'  printf("{cls.c_name} %zu\\n", sizeof({cls.c_name}));')
        expected.append(f"{cls.c_name} {ctypes.sizeof(cls)}")
        for name, *_ in cls._fields_:
            lines.append(f'  printf("{cls.c_name}.{name} %zu\\n", offsetof({cls.c_name}, {name}));')
            expected.append(f"{cls.c_name}.{name} {getattr(cls, name).offset}")
    # The ABI 1.1 plan size a library still accepts: where the E4M3 copies begin, frozen at 496 bytes.
    lines.append('  printf("FPV2_CORRECTION_PLAN_SIZE_V1_1 %u\\n", (unsigned)FPV2_CORRECTION_PLAN_SIZE_V1_1);')
    expected.append(f"FPV2_CORRECTION_PLAN_SIZE_V1_1 {cs.CorrectionPlanStruct.pooled_k_e4m3.offset}")
    assert cs.CORRECTION_PLAN_SIZE_V1_1 == cs.CorrectionPlanStruct.pooled_k_e4m3.offset == 496
    # The ABI 1.2 size: where the key spread begins, frozen at 816 bytes.
    lines.append('  printf("FPV2_CORRECTION_PLAN_SIZE_V1_2 %u\\n", (unsigned)FPV2_CORRECTION_PLAN_SIZE_V1_2);')
    expected.append(f"FPV2_CORRECTION_PLAN_SIZE_V1_2 {cs.CorrectionPlanStruct.key_variance.offset}")
    assert cs.CORRECTION_PLAN_SIZE_V1_2 == cs.CorrectionPlanStruct.key_variance.offset == 816
    lines += ["  return 0;", "}"]
    ran = 0
    for compiler in ("cc", "c++"):
        if shutil.which(compiler) is None:
            continue
        assert run_against_header("\n".join(lines) + "\n", compiler).splitlines() == expected
        ran += 1
    if ran == 0:
        pytest.skip("no C or C++ compiler on PATH")


def test_tensor_desc_mapping() -> None:
    t = torch.zeros(3, 4, 5, dtype=torch.float16).transpose(0, 2)
    desc = cs.tensor_desc(t)
    assert desc.data == t.data_ptr() and desc.dtype == native.DType.F16 and desc.ndim == 3
    assert list(desc.shape)[:3] == [5, 4, 3] and list(desc.strides)[:3] == [1, 5, 20]
    for torch_dtype, code in cs.TORCH_TO_DTYPE.items():
        assert cs.tensor_desc(torch.zeros(2, dtype=torch_dtype)).dtype == code
    absent = cs.tensor_desc(None)
    assert absent.data is None and absent.ndim == 0
    with pytest.raises(TypeError, match="float64"):
        cs.tensor_desc(torch.zeros(2, dtype=torch.float64), "x")
    with pytest.raises(ValueError, match="rank 5"):
        cs.tensor_desc(torch.zeros(1, 1, 1, 1, 1), "x")


def _e4m3_case() -> tuple[Case, BlockIndex, CorrectionPlan, PooledE4M3]:
    """The standard case on 128-token pages, with its plan's E4M3 copies (from the reference)."""
    case = Case(page_size=128)
    index, plan = case.index_and_plan()
    stats = plan.statistics
    return case, index, plan, quantize_pooled_e4m3_reference(stats.pooled_k, stats.pooled_v, stats.block_offsets)


def test_correction_plan_struct_fills_the_e4m3_copies() -> None:
    case, index, plan, copies = _e4m3_case()
    stats = plan.statistics
    struct = cs.correction_plan_struct(plan, pooled_dtype=torch.bfloat16, pooled_e4m3=copies)
    # With the copies, the float32 statistics go over as they are (the FP8 correction does not read them).
    assert struct.pooled_k.dtype == struct.pooled_v.dtype == DType.F32
    assert struct.pooled_k.data == stats.pooled_k.data_ptr() and struct.pooled_v.data == stats.pooled_v.data_ptr()
    fields = {
        "pooled_k_e4m3": (copies.k, DType.E4M3),
        "pooled_vt_e4m3": (copies.vt, DType.E4M3),
        "e4m3_offsets": (copies.offsets, DType.I32),
        "e4m3_scales": (copies.scales, DType.F32),
    }
    rows = copies.rows
    assert copies.k.shape == (rows, case.num_kv_heads, case.head_dim) and rows % 16 == 0
    assert copies.vt.shape == (case.num_kv_heads, case.head_dim, rows)
    for name, (tensor, code) in fields.items():
        desc = getattr(struct, name)
        assert desc.data == tensor.data_ptr() and desc.dtype == code and desc.ndim == tensor.dim(), name
        assert list(desc.shape)[: tensor.dim()] == list(tensor.shape), name
        assert list(desc.strides)[: tensor.dim()] == list(tensor.stride()), name
    # Without them the four fields are absent and pooled_dtype applies.
    plain = cs.correction_plan_struct(plan, pooled_dtype=torch.bfloat16)
    assert plain.pooled_k.dtype == plain.pooled_v.dtype == DType.BF16
    for name in fields:
        assert getattr(plain, name).data is None and getattr(plain, name).ndim == 0, name
    with pytest.raises(TypeError, match="pooled_e4m3 must be a PooledE4M3"):
        cs.correction_plan_struct(plan, pooled_e4m3=copies.k)
    # prefill_args_struct forwards them, and the struct keeps them alive.
    _, _, _, copies = _e4m3_case()
    args = case.args(index=index, plan=plan, pooled_e4m3=copies)
    assert args.correction.contents.pooled_vt_e4m3.data == copies.vt.data_ptr()
    alive = weakref.ref(copies.vt)
    del copies, fields
    gc.collect()
    assert alive() is not None
    del args
    gc.collect()
    assert alive() is None


def test_args_keep_tensors_alive() -> None:
    case = Case()
    q = case.q.clone()
    alive = weakref.ref(q)
    args = case.args(q=q)
    del q
    gc.collect()
    assert alive() is not None and args.q.data == alive().data_ptr()
    del args
    gc.collect()
    assert alive() is None


# --------------------------------------------------------------------------------------------- struct_size
def _sized_calls(case: Case) -> list[tuple[ctypes.Structure, object]]:
    """(struct, call validating it) for each size-prefixed struct, all otherwise valid."""
    index, plan = case.index_and_plan()
    args = case.args(index=index, plan=plan)
    batch = args.batch.contents
    index_s, plan_s = args.index.contents, args.correction.contents
    ptr = ctypes.byref
    return [
        (batch, lambda s: LIB.fpv2_validate_paged_batch(ptr(s))),
        (index_s, lambda s: LIB.fpv2_validate_block_index(ptr(s), ptr(batch))),
        (plan_s, lambda s: LIB.fpv2_validate_correction_plan(ptr(s), ptr(batch))),
        (args, lambda s: LIB.fpv2_validate_prefill(ptr(s))),
    ]


@needs_library
def test_too_small_struct_size_is_rejected() -> None:
    case = Case()
    for struct, call in _sized_calls(case):
        size = ctypes.sizeof(struct)
        # The correction plan's ABI 1.1 size is still read (without the E4M3 copies): smaller is refused.
        smallest = cs.CORRECTION_PLAN_SIZE_V1_1 if isinstance(struct, cs.CorrectionPlanStruct) else size
        assert call(struct) == Status.OK, _last_error()
        struct.struct_size = smallest - 8
        assert call(struct) == Status.INVALID_ARGUMENT
        message = _last_error()
        name = type(struct).c_name
        assert f"{name}.struct_size={smallest - 8}" in message and f"{name} ({size} bytes" in message, message
        struct.struct_size = size


@needs_library
def test_larger_struct_size_from_newer_minor_is_accepted() -> None:
    case = Case()
    for struct, call in _sized_calls(case):
        size = ctypes.sizeof(struct)
        buffer = (ctypes.c_ubyte * (size + 64))(*([0xAB] * (size + 64)))  # garbage "newer" tail fields
        ctypes.memmove(buffer, ctypes.byref(struct), size)
        grown = type(struct).from_buffer(buffer)
        grown.struct_size = size + 64
        assert call(grown) == Status.OK, _last_error()


@needs_library
def test_plan_of_the_abi_1_1_size_is_read_without_its_tail() -> None:
    case, index, plan, copies = _e4m3_case()
    args = case.args(index=index, plan=plan, pooled_e4m3=copies)
    plan_s, batch = args.correction.contents, args.batch
    assert LIB.fpv2_validate_correction_plan(ctypes.byref(plan_s), batch) == Status.OK, _last_error()
    plan_s.e4m3_scales = cs.tensor_desc(None)  # three of the four copies: refused, naming the missing one
    assert LIB.fpv2_validate_correction_plan(ctypes.byref(plan_s), batch) == Status.INVALID_ARGUMENT
    assert "fpv2_correction_plan_t" in _last_error() and "e4m3_scales" in _last_error()
    # A caller built against ABI 1.1 sets the old size: the fields past it are not read, whatever they hold.
    plan_s.struct_size = cs.CORRECTION_PLAN_SIZE_V1_1
    assert LIB.fpv2_validate_correction_plan(ctypes.byref(plan_s), batch) == Status.OK, _last_error()
    assert _validate(args) == Status.OK, _last_error()


def _spread_case() -> tuple[Case, BlockIndex, CorrectionPlan]:
    """The standard case with a key spread in its plan (the second-order mass shift, ABI 1.5)."""
    case = Case()
    index, plan = case.index_and_plan()
    shape = plan.statistics.pooled_k.shape[:2]
    spread = KeySpread(torch.rand(shape), torch.rand(shape) + 1.0)
    return case, index, dataclasses.replace(plan, key_spread=spread)


def test_correction_plan_struct_fills_the_key_spread() -> None:
    _, _, plan = _spread_case()
    struct = cs.correction_plan_struct(plan)
    for name, tensor in (("key_variance", plan.key_spread.variance), ("key_radius", plan.key_spread.radius)):
        desc = getattr(struct, name)
        assert desc.data == tensor.data_ptr() and desc.dtype == DType.F32 and desc.ndim == 2, name
        assert list(desc.shape)[:2] == list(tensor.shape) and list(desc.strides)[:2] == [tensor.shape[1], 1], name
    mean_only = cs.correction_plan_struct(dataclasses.replace(plan, key_spread=None))
    assert mean_only.key_variance.data is None and mean_only.key_radius.ndim == 0


@needs_library
def test_key_spread_is_validated_by_name() -> None:
    case, index, plan = _spread_case()
    args = case.args(index=index, plan=plan)
    plan_s, batch = args.correction.contents, args.batch
    assert LIB.fpv2_validate_correction_plan(ctypes.byref(plan_s), batch) == Status.OK, _last_error()
    assert _validate(args) == Status.OK, _last_error()
    variance, radius = plan.key_spread.variance, plan.key_spread.radius
    bad = {
        "key_radius": (cs.tensor_desc(None), "come together"),
        "key_variance": (cs.tensor_desc(variance.to(torch.int32)), "key_variance"),
        "key_variance ": (cs.tensor_desc(variance[:-1]), "(total_blocks, Hkv)"),
        "key_radius ": (cs.tensor_desc(radius.T.contiguous().T), "key_radius"),
    }
    for field_name, (desc, expected) in bad.items():
        name = field_name.strip()
        kept = cs.TensorDesc.from_buffer_copy(getattr(plan_s, name))  # a field reads through to the struct
        setattr(plan_s, name, desc)
        assert LIB.fpv2_validate_correction_plan(ctypes.byref(plan_s), batch) == Status.INVALID_ARGUMENT, field_name
        assert "fpv2_correction_plan_t" in _last_error() and expected in _last_error(), (field_name, _last_error())
        setattr(plan_s, name, kept)
    # A caller built against ABI 1.2 to 1.4 sets the older size: the spread past it is not read (mean only).
    plan_s.key_radius = cs.tensor_desc(None)
    plan_s.struct_size = cs.CORRECTION_PLAN_SIZE_V1_2
    assert LIB.fpv2_validate_correction_plan(ctypes.byref(plan_s), batch) == Status.OK, _last_error()


@needs_library
def test_null_pointers_are_rejected() -> None:
    assert LIB.fpv2_validate_paged_batch(None) == Status.INVALID_ARGUMENT
    assert "batch is NULL" in _last_error() and "fpv2_paged_batch_t" in _last_error()
    assert LIB.fpv2_validate_prefill(None) == Status.INVALID_ARGUMENT
    assert "args is NULL" in _last_error()
    args = Case().args()
    args.batch = None
    assert _validate(args) == Status.INVALID_ARGUMENT and "batch is NULL" in _last_error()


# --------------------------------------------------------------------------------------------- bad fields
def _bad_dtype_code(case: Case) -> cs.PrefillArgsStruct:
    args = case.args()
    args.q.dtype = 99
    return args


def _page_size_zero(case: Case) -> cs.PrefillArgsStruct:
    args = case.args()
    args.batch.contents.page_size = 0
    return args


def _hq_not_multiple(case: Case) -> cs.PrefillArgsStruct:
    shape = (case.batch.num_pages, case.page_size, 4, case.head_dim)
    q = torch.zeros(case.q.shape[0], 6, case.head_dim, dtype=case.dtype)
    kv = torch.zeros(shape, dtype=case.dtype)
    return case.args(q=q, k_cache=kv, v_cache=kv, out=torch.zeros_like(q))


def _head_dim_96(case: Case) -> cs.PrefillArgsStruct:
    q = torch.zeros(case.q.shape[0], case.num_q_heads, 96, dtype=case.dtype)
    kv = torch.zeros(case.batch.num_pages, case.page_size, case.num_kv_heads, 96, dtype=case.dtype)
    return case.args(q=q, k_cache=kv, v_cache=kv, out=torch.zeros_like(q))


def _index_tile_64(case: Case) -> cs.PrefillArgsStruct:
    args = case.args(index=case.index_and_plan()[0])
    args.index.contents.tile_size = 64
    return args


def _fp8_missing_q_descale(case: Case) -> cs.PrefillArgsStruct:
    fp8 = Case(dtype=torch.float8_e4m3fn)
    scales = fp8.descales()
    return fp8.args(q_descale=None, k_descale=scales["k_descale"], v_descale=scales["v_descale"])


def _no_causal_flag(case: Case) -> cs.PrefillArgsStruct:
    args = case.args()
    args.flags = 0
    return args


def _k_cache_dtype(case: Case) -> cs.PrefillArgsStruct:
    return case.args(k_cache=case.k_cache.half())


def _out_shape(case: Case) -> cs.PrefillArgsStruct:
    return case.args(out=case.out[:-1])


def _q_inner_stride(case: Case) -> cs.PrefillArgsStruct:
    q = torch.zeros(case.q.shape[0], case.head_dim, case.num_q_heads, dtype=case.dtype).transpose(1, 2)
    return case.args(q=q)


def _index_group(case: Case) -> cs.PrefillArgsStruct:
    args = case.args(index=case.index_and_plan()[0])
    args.index.contents.group = 2
    return args


def _plan_chunk(case: Case) -> cs.PrefillArgsStruct:
    index, plan = case.index_and_plan()
    args = case.args(index=index, plan=plan)
    args.correction.contents.chunk_size = 32
    return args


def _plan_block_size(case: Case) -> cs.PrefillArgsStruct:
    index, plan = case.index_and_plan()
    args = case.args(index=index, plan=plan)
    args.correction.contents.block_size = 64
    return args


def _plan_without_index(case: Case) -> cs.PrefillArgsStruct:
    return case.args(plan=case.index_and_plan()[1])


def _descale_for_bf16(case: Case) -> cs.PrefillArgsStruct:
    return case.args(**case.descales())


def _lse_dtype(case: Case) -> cs.PrefillArgsStruct:
    return case.args(lse=torch.zeros(case.q.shape[0], case.num_q_heads, dtype=torch.float16))


def _f32_inputs(case: Case) -> cs.PrefillArgsStruct:
    return Case(dtype=torch.float32).args()


def _null_data(case: Case) -> cs.PrefillArgsStruct:
    args = case.args()
    args.v_cache.data = None
    return args


def _segments(case: Case) -> cs.PrefillArgsStruct:
    args = case.args(index=case.index_and_plan()[0])
    args.index.contents.num_segments += case.num_kv_heads  # 7 tiles per head; the batch has 5..6
    return args


def _page_table_short(case: Case) -> cs.PrefillArgsStruct:
    args = case.args()
    args.batch.contents.max_seqlen_k = 10_000
    return args


BAD_CASES = [
    (_bad_dtype_code, Status.INVALID_ARGUMENT, ["fpv2_prefill_args_t.q", "dtype code 99"]),
    (_page_size_zero, Status.INVALID_ARGUMENT, ["fpv2_paged_batch_t.page_size=0", "> 0"]),
    (_hq_not_multiple, Status.INVALID_ARGUMENT, ["Hq % Hkv != 0", "Hq=6", "Hkv=4"]),
    (_head_dim_96, Status.UNSUPPORTED, ["head dim d=96", "{64, 128, 256}"]),
    (_index_tile_64, Status.INVALID_ARGUMENT, ["tile_size=64", "kernel's tile size"]),
    (_fp8_missing_q_descale, Status.INVALID_ARGUMENT, ["q_descale is required", "float8_e4m3fn", "(2, 2)"]),
    (_no_causal_flag, Status.INVALID_ARGUMENT, ["flags=0x0", "FPV2_PREFILL_CAUSAL"]),
    (_k_cache_dtype, Status.INVALID_ARGUMENT, ["k_cache must have q's dtype bf16", "dtype f16"]),
    (_out_shape, Status.INVALID_ARGUMENT, ["fpv2_prefill_args_t.out must have shape", "(137, 8, 64)", "(136, 8, 64)"]),
    (_q_inner_stride, Status.INVALID_ARGUMENT, ["fpv2_prefill_args_t.q must have unit stride", "strides (512, 1, 8)"]),
    (_index_group, Status.INVALID_ARGUMENT, ["fpv2_block_index_t.group=2", "= 4"]),
    (_plan_chunk, Status.INVALID_ARGUMENT, ["chunk_size=32", "expected 64"]),
    (_plan_block_size, Status.INVALID_ARGUMENT, ["fpv2_correction_plan_t.block_size=64", "block_size=128"]),
    (_plan_without_index, Status.INVALID_ARGUMENT, ["correction is set but index is NULL"]),
    (_descale_for_bf16, Status.INVALID_ARGUMENT, ["q_descale is only meaningful for float8_e4m3fn"]),
    (_lse_dtype, Status.INVALID_ARGUMENT, ["fpv2_prefill_args_t.lse must have dtype f32", "dtype f16"]),
    (_f32_inputs, Status.UNSUPPORTED, ["dtype f32", "reference backend"]),
    (_null_data, Status.INVALID_ARGUMENT, ["v_cache has data == NULL"]),
    (_segments, Status.INVALID_ARGUMENT, ["num_segments=14", "5 <= tiles <= 6"]),
    (_page_table_short, Status.INVALID_ARGUMENT, ["page_table is too short", "max_seqlen_k=10000"]),
]


@needs_library
@pytest.mark.parametrize(("make", "status", "fragments"), BAD_CASES, ids=[c[0].__name__.strip("_") for c in BAD_CASES])
def test_bad_fields_are_rejected_with_a_message(make, status: Status, fragments: list[str]) -> None:
    args = make(Case())
    assert _validate(args) == status
    message = _last_error()
    for fragment in fragments:
        assert fragment in message, message
    # fpv2_prefill validates first: it reports the same error, not NOT_BUILT.
    assert LIB.fpv2_prefill(ctypes.byref(args)) == status and _last_error() == message
    expected_exc = native.UnsupportedConfigurationError if status == Status.UNSUPPORTED else ValueError
    with pytest.raises(expected_exc) as info:
        native.check_status(status)
    assert str(info.value) == message


@needs_library
def test_python_api_raises_with_the_library_message() -> None:
    case = Case(num_q_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"Hq % Hkv != 0.*Hq=6.*Hkv=4"):
        native.validate_prefill_native(case.q, case.k_cache, case.v_cache, case.out, case.batch)
    case = Case(head_dim=96)
    with pytest.raises(native.UnsupportedConfigurationError, match="head dim d=96") as info:
        native.validate_prefill_native(case.q, case.k_cache, case.v_cache, case.out, case.batch)
    assert info.value.status == Status.UNSUPPORTED


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (Status.INVALID_ARGUMENT, ValueError),
        (Status.UNSUPPORTED, native.UnsupportedConfigurationError),
        (Status.NOT_BUILT, native.HopperKernelNotBuiltError),
        (Status.CUDA, native.NativeError),
        (Status.WORKSPACE_TOO_SMALL, native.NativeError),
        (Status.INTERNAL, native.NativeError),
        (77, native.NativeError),
    ],
)
def test_check_status_maps_codes(code: int, cls: type[Exception]) -> None:
    with pytest.raises(cls, match="injected message") as info:
        native.check_status(code, "injected message")
    assert info.value.status == code
    native.check_status(Status.OK)


# --------------------------------------------------------------------------------------------- valid calls
def _valid_variants() -> dict[str, cs.PrefillArgsStruct]:
    case = Case()
    index, plan = case.index_and_plan()
    plain_plan = CorrectionPlan(plan.statistics)  # kernel derives the todo bits itself
    fp8 = Case(dtype=torch.float8_e4m3fn, head_dim=128)
    big = Case(dtype=torch.float16, num_q_heads=4, num_kv_heads=4, head_dim=256, page_size=1)
    empty = Case(seqlens_q=(0, 0), seqlens_k=(5, 0))
    variants = {
        "dense": case.args(),
        "sparse": case.args(index=index),
        "corrected_with_todo": case.args(index=index, plan=plan, lse=torch.zeros(137, 8), softmax_scale=0.1),
        "corrected_derived_todo": case.args(index=index, plan=plain_plan),
        "fp8": fp8.args(),
        "f16_d256_mha_page1": big.args(),
        "no_queries": empty.args(),
    }
    # An index keeping no block: its zero-element blocks tensor may have NULL data.
    empty_index = BlockIndex.from_dense_mask(
        index.to_dense_mask() & False, index.tile_offsets, num_kv_heads=case.num_kv_heads, group=case.group
    )
    args = case.args(index=empty_index)
    args.index.contents.blocks.data = None
    assert args.index.contents.blocks.shape[0] == 0
    variants["null_data_zero_elements"] = args
    return variants


@needs_library
@pytest.mark.parametrize("name", list(_valid_variants()))
def test_valid_arguments_pass(name: str) -> None:
    args = _valid_variants()[name]
    assert _validate(args) == Status.OK, _last_error()
    assert _last_error() == ""


@needs_library
def test_valid_structs_pass_alone() -> None:
    case = Case()
    index, plan = case.index_and_plan()
    args = case.args(index=index, plan=plan)
    assert LIB.fpv2_validate_paged_batch(args.batch) == Status.OK
    assert LIB.fpv2_validate_block_index(args.index, args.batch) == Status.OK
    assert LIB.fpv2_validate_correction_plan(args.correction, args.batch) == Status.OK
    assert _last_error() == ""


# --------------------------------------------------------------------------------------------- prefill
@needs_library
@pytest.mark.skipif(HAS_KERNEL, reason="this library contains the Hopper kernel (built with it by default)")
def test_prefill_reports_not_built() -> None:
    case = Case()
    index, plan = case.index_and_plan()
    args = case.args(index=index, plan=plan)
    assert LIB.fpv2_hopper_kernel_available() == 0
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.NOT_BUILT
    message = _last_error()
    assert "Hopper attention kernel is not part of this build" in message
    assert "reference" in message and "portable" in message
    with pytest.raises(native.HopperKernelNotBuiltError, match="not part of this build") as info:
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, case.out, case.batch, index=index, plan=plan)
    assert str(info.value) == message
    available, reason = native.hopper_available()
    assert available is False and "not part of this build" in reason


@needs_library
@pytest.mark.skipif(not HAS_KERNEL, reason="this library was built without the Hopper kernel")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU tensors of this case must not reach a GPU launch")
@pytest.mark.parametrize("head_dim", BUILT_HEAD_DIMS or [128])
def test_prefill_with_the_kernel_but_no_gpu_reports_the_cuda_failure(head_dim: int) -> None:
    # Arguments the kernel serves (bf16, a built head dim, page 128, dense) pass validation and the launcher's
    # own checks; the launcher then finds no CUDA device and says so (nothing is launched).
    case = Case(head_dim=head_dim, page_size=128)
    args = case.args()
    assert LIB.fpv2_hopper_kernel_available() == 1
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.CUDA
    message = _last_error()
    assert "Hopper" in message and "cuda" in message.lower()
    available, reason = native.hopper_available()
    assert available is False and "CUDA" in reason


@needs_library
@pytest.mark.skipif(not HAS_KERNEL, reason="this library was built without the Hopper kernel")
@pytest.mark.parametrize("head_dim", [d for d in SUPPORTED_HEAD_DIMS if d not in BUILT_HEAD_DIMS] or [None])
def test_head_dims_without_an_instantiation_are_refused_by_name(head_dim: int | None) -> None:
    # The ABI accepts d in {64, 128, 256}; the launcher refuses the ones this build has no instantiation for,
    # naming the head dim and the built ones, before any device work (so on machines without a GPU too).
    if head_dim is None:
        pytest.skip("this library has an instantiation for every head dim the contracts accept")
    case = Case(head_dim=head_dim, page_size=128)
    args = case.args()
    assert _validate(args) == Status.OK
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.UNSUPPORTED
    message = _last_error()
    built = ", ".join(map(str, BUILT_HEAD_DIMS))
    assert f"head dim d={head_dim} has no compiled Hopper instantiation" in message
    assert f"(built: d={built})" in message and "fpv2_prefill_args_t.q" in message
    with pytest.raises(native.UnsupportedConfigurationError) as info:
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, case.out, case.batch)
    assert str(info.value) == message


@needs_library
@pytest.mark.skipif(not HAS_KERNEL, reason="this library was built without the Hopper kernel")
def test_unknown_kernel_variants_in_the_environment_are_refused(monkeypatch) -> None:
    # Read before any device work, so the refusal shows on machines without a GPU too.
    case = Case(head_dim=128, page_size=16)
    args = case.args()
    monkeypatch.setenv("FPV2_HOPPER_GATHER", "diagonal")
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.INVALID_ARGUMENT
    assert "FPV2_HOPPER_GATHER=diagonal" in _last_error() and 'expected "quads"' in _last_error()
    assert "removed" not in _last_error()
    # The layouts measured slower than four lanes a row are gone: naming one is refused, not run as quads.
    for removed in ("warp", "pairs"):
        monkeypatch.setenv("FPV2_HOPPER_GATHER", removed)
        assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.INVALID_ARGUMENT
        assert f"FPV2_HOPPER_GATHER={removed}" in _last_error() and "were removed" in _last_error()
    monkeypatch.setenv("FPV2_HOPPER_GATHER", "quads")
    monkeypatch.setenv("FPV2_HOPPER_PINGPONG", "yes")
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.INVALID_ARGUMENT
    assert "FPV2_HOPPER_PINGPONG=yes" in _last_error()
    monkeypatch.setenv("FPV2_HOPPER_PINGPONG", "1")
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "true")
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.INVALID_ARGUMENT
    assert "FPV2_HOPPER_PERSISTENT=true" in _last_error() and "expected 0, 1 or dynamic" in _last_error()
    # The dynamic tile queue is built for the overlapped consumers only (pingpong turns them off here).
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "dynamic")
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.INVALID_ARGUMENT
    assert "FPV2_HOPPER_PERSISTENT=dynamic: the tile queue is built for the overlapped consumers" in _last_error()
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "0")
    monkeypatch.setenv("FPV2_HOPPER_OVERLAP", "on")
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.INVALID_ARGUMENT
    assert "FPV2_HOPPER_OVERLAP=on" in _last_error()
    # The overlapped consumers are a separate instantiation without the pingpong turns: asking for both is
    # refused, not half-served.
    monkeypatch.setenv("FPV2_HOPPER_OVERLAP", "1")
    assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.INVALID_ARGUMENT
    assert "FPV2_HOPPER_OVERLAP=1 cannot be combined with FPV2_HOPPER_PINGPONG=1" in _last_error()
    # Persistent CTAs have an overlapped instantiation of their own: OVERLAP=1 with PERSISTENT=1 is served
    # (the call then fails later, on this machine's device check or the case's missing GPU, not on the switch).
    monkeypatch.setenv("FPV2_HOPPER_PINGPONG", "0")
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "1")
    LIB.fpv2_prefill(ctypes.byref(args))
    assert "cannot be combined" not in _last_error()
    # Unset, the overlap default gives way to an explicit pingpong request: no refusal there either.
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "0")
    monkeypatch.setenv("FPV2_HOPPER_PINGPONG", "1")
    monkeypatch.delenv("FPV2_HOPPER_OVERLAP")
    LIB.fpv2_prefill(ctypes.byref(args))
    assert "FPV2_HOPPER_OVERLAP" not in _last_error()
    monkeypatch.setenv("FPV2_HOPPER_PINGPONG", "0")
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "0")
    monkeypatch.setenv("FPV2_HOPPER_OVERLAP", "0")
    # The plain on/off switches: a value other than 0 / 1 is refused, naming the switch and its default.
    for name, bad, default in (("REQUEST_MAJOR", "yes", 1), ("POOLED_HALF_EXP", "half", 0), ("HEAD_MAJOR", "on", 1)):
        monkeypatch.setenv(f"FPV2_HOPPER_{name}", bad)
        assert LIB.fpv2_prefill(ctypes.byref(args)) == Status.INVALID_ARGUMENT
        assert f"FPV2_HOPPER_{name}={bad}" in _last_error() and f"(unset: {default})" in _last_error()
        monkeypatch.setenv(f"FPV2_HOPPER_{name}", str(default))


@needs_library
def test_pooled_statistics_may_be_bf16_but_both_alike() -> None:
    case = Case()
    index, plan = case.index_and_plan()
    args = case.args(index=index, plan=plan)
    plan_struct = args.correction.contents
    plan_struct.pooled_k.dtype = int(DType.BF16)
    plan_struct.pooled_v.dtype = int(DType.BF16)
    assert LIB.fpv2_validate_correction_plan(args.correction, args.batch) == Status.OK
    plan_struct.pooled_v.dtype = int(DType.F32)
    assert LIB.fpv2_validate_correction_plan(args.correction, args.batch) == Status.INVALID_ARGUMENT
    assert "fpv2_correction_plan_t.pooled_v" in _last_error()


# --------------------------------------------------------------------------------------------- threads
@needs_library
def test_last_error_is_thread_local() -> None:
    bad = Case().args()
    bad.flags = 0
    assert _validate(bad) == Status.INVALID_ARGUMENT
    main_message = _last_error()
    assert "FPV2_PREFILL_CAUSAL" in main_message
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["before"] = _last_error()
        seen["code"] = LIB.fpv2_validate_paged_batch(None)
        seen["after"] = _last_error()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["before"] == ""  # the main thread's error is not visible on a new thread
    assert seen["code"] == Status.INVALID_ARGUMENT and "batch is NULL" in str(seen["after"])
    assert _last_error() == main_message  # nor is the worker's error visible here
    assert _validate(Case().args()) == Status.OK
    assert _last_error() == ""  # success clears this thread's message


# --------------------------------------------------------------------------------------------- exports
def _check_symbols(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK_SYMBOLS), *args], capture_output=True, text=True, check=False)


@needs_library
@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_exported_symbols_are_exactly_the_abi() -> None:
    result = _check_symbols(str(LIB_PATH), "--header", str(IN_TREE_HEADER))
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


@needs_library
@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("cc") is None, reason="needs nm and cc")
def test_symbol_check_catches_leaks_and_missing_functions(tmp_path: Path) -> None:
    source = tmp_path / "leaky.c"
    source.write_text(
        "int leaky_helper(void) { return 1; }\n"
        "void fpv2_get_abi_version(int* major, int* minor) { *major = 1; *minor = 0; }\n"
    )
    lib = tmp_path / "libleaky.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(lib)], check=True)
    result = _check_symbols(str(lib), "--header", str(IN_TREE_HEADER))
    assert result.returncode == 1
    assert "leaky_helper" in result.stderr  # a symbol without the fpv2_ prefix
    assert "fpv2_prefill" in result.stderr and "not exported" in result.stderr  # declared but missing
    header = tmp_path / "extra.h"
    header.write_text(IN_TREE_HEADER.read_text() + "\nFPV2_API int32_t fpv2_future_function(void);\n")
    result = _check_symbols(str(LIB_PATH), "--header", str(header))
    assert result.returncode == 1 and "fpv2_future_function" in result.stderr
