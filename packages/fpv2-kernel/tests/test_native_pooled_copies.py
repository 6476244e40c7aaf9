"""The binding hands over the statistics' own copies of the pooled K/V (duck-typed ``pooled_in``) when they fit.

Statistics that carry copies in the dtype the Hopper kernel reads (``fpv2.index``'s Triton
pooling writes bf16 ones) spare ``correction_plan_struct`` its two conversions per call; copies
of the wrong dtype, shape or device, a missing V copy, or none at all mean a conversion as before.
No ``fpv2.index`` here: a stand-in class offers the method.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fpv2.kernel._native import structs as cs
from fpv2.kernel.contracts import BlockStatistics, CorrectionPlan

BF16 = torch.bfloat16


@dataclass(frozen=True, eq=False)
class _WithCopies(BlockStatistics):
    """Statistics offering whatever ``copies`` holds for ``dtype`` (None: nothing)."""

    copies: tuple[torch.Tensor, torch.Tensor | None] | None = None
    dtype: torch.dtype = BF16

    def pooled_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        return self.copies if dtype == self.dtype else None


def _means(blocks: int = 5, heads: int = 2, dim: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    pk = torch.randn(blocks, heads, dim, generator=gen)
    pv = torch.randn(blocks, heads, dim, generator=gen)
    lengths = torch.full((blocks,), 16, dtype=torch.int32)
    offsets = torch.tensor([0, blocks], dtype=torch.int32)
    return pk, pv, lengths, offsets


def _struct(copies, dtype=BF16) -> tuple[cs.CorrectionPlanStruct, BlockStatistics]:
    pk, pv, lengths, offsets = _means()
    stats = _WithCopies(pk, pv, lengths, offsets, 16, copies=copies(pk, pv) if copies else None, dtype=dtype)
    return cs.correction_plan_struct(CorrectionPlan(stats), pooled_dtype=BF16), stats


def test_current_copies_are_handed_over() -> None:
    struct, stats = _struct(lambda pk, pv: (pk.to(BF16), pv.to(BF16)))
    k, v = stats.copies
    assert struct.pooled_k.data == k.data_ptr() and struct.pooled_v.data == v.data_ptr()
    assert struct.pooled_k.dtype == struct.pooled_v.dtype == cs.DType.BF16
    # The struct keeps what it points into alive.
    assert any(t is k for t in struct._fpv2_keepalive) and any(t is v for t in struct._fpv2_keepalive)


@pytest.mark.parametrize(
    "copies",
    [
        None,  # statistics without copies
        lambda pk, pv: (pk.half(), pv.half()),  # offered as bf16 but of another dtype
        lambda pk, pv: (pk[:-1].to(BF16), pv[:-1].to(BF16)),  # another shape
        lambda pk, pv: (pk.to(BF16), None),  # no V copy for statistics with V
        lambda pk, pv: (pk.to(BF16), pv[:, :1].to(BF16)),  # a V copy of another shape
    ],
    ids=["none", "dtype", "shape", "no-v", "v-shape"],
)
def test_unfit_copies_are_not_used(copies) -> None:
    struct, stats = _struct(copies)
    offered = [t.data_ptr() for t in (stats.copies or ()) if t is not None]
    assert struct.pooled_k.data not in offered and struct.pooled_v.data not in offered
    assert struct.pooled_k.dtype == struct.pooled_v.dtype == cs.DType.BF16
    kept_k, kept_v = struct._fpv2_keepalive[1:3]  # the conversions, kept alive
    assert torch.equal(kept_k, stats.pooled_k.to(BF16)) and torch.equal(kept_v, stats.pooled_v.to(BF16))


def test_copies_of_another_dtype_than_asked_are_not_looked_at() -> None:
    struct, stats = _struct(lambda pk, pv: (pk.to(BF16), pv.to(BF16)), dtype=torch.float16)
    assert struct.pooled_k.data != stats.copies[0].data_ptr()
    # Without a pooled dtype the fp32 means go over unconverted, copies or not.
    plain = cs.correction_plan_struct(CorrectionPlan(stats))
    assert plain.pooled_k.data == stats.pooled_k.data_ptr() and plain.pooled_k.dtype == cs.DType.F32
