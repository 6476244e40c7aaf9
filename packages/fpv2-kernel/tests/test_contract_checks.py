"""The shared argument checks of the contracts: what they accept, what they refuse, how they word it."""

from __future__ import annotations

import re

import pytest
import torch

from fpv2.kernel.contracts._checks import check_shape, check_tensor


def test_check_shape_matches_sizes_and_wildcards() -> None:
    t = torch.zeros(2, 3, 4)
    check_shape("x", t, (2, 3, 4))
    check_shape("x", t, (None, 3, None))
    check_shape("x", t, [2, None, 4])
    check_shape("s", torch.zeros(()), ())


@pytest.mark.parametrize(
    "expected,want",
    [
        ((2, 3, 5), "(2, 3, 5)"),  # a wrong size
        ((None, 4, None), "(*, 4, *)"),  # a wrong size next to wildcards
        ((2, 3), "(2, 3)"),  # fewer dimensions expected
        ((2, 3, 4, 1), "(2, 3, 4, 1)"),  # more dimensions expected
        ((None, None), "(*, *)"),  # wildcards of another rank
        ((), "()"),
    ],
)
def test_check_shape_refuses_other_shapes_and_ranks(expected, want) -> None:
    with pytest.raises(ValueError, match=re.escape(f"x must have shape {want}; got shape (2, 3, 4)")):
        check_shape("x", torch.zeros(2, 3, 4), expected)


def test_check_tensor_type_dtype_rank_device() -> None:
    t = torch.zeros(2, 3, dtype=torch.float16)
    assert check_tensor("x", t, dtypes=(torch.float16, torch.float32), ndim=2, device=torch.device("cpu")) is t
    assert check_tensor("x", t, dtypes=[torch.float16], device="cpu") is t  # a list of dtypes, a device string
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        check_tensor("x", [1.0], dtypes=(torch.float16,))
    with pytest.raises(TypeError, match=r"x must have dtype in \(torch.float32\); got shape \(2, 3\)"):
        check_tensor("x", t, dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="x must have rank 3"):
        check_tensor("x", t, dtypes=(torch.float16,), ndim=3)
    with pytest.raises(ValueError, match="x must be on meta like the other inputs"):
        check_tensor("x", t, dtypes=(torch.float16,), device=torch.device("meta"))
    with pytest.raises(ValueError, match="x must be on meta like the other inputs"):
        check_tensor("x", t, dtypes=(torch.float16,), device="meta")
