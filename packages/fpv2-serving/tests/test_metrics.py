"""fpv2.serving.metrics.relative_l2_error: the accuracy figure of every benchmark record."""

from __future__ import annotations

import math

import pytest
import torch

from fpv2.serving.metrics import relative_l2_error


def test_relative_l2_error_matches_its_definition_at_once_and_in_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(37, 5, 16, generator=gen)
    out = ref + 0.01 * torch.randn(37, 5, 16, generator=gen)
    expected = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert relative_l2_error(out, ref) == pytest.approx(expected, rel=1e-12)
    # Chunks that do and do not divide the 185 rows give the same sum.
    for rows in (1, 7, 185, 1000):
        assert relative_l2_error(out, ref, chunk_rows=rows) == pytest.approx(expected, rel=1e-12)


def test_relative_l2_error_edge_cases() -> None:
    zero = torch.zeros(3, 4)
    assert relative_l2_error(zero, zero) == 0.0
    assert relative_l2_error(torch.full((3, 4), 2.0), zero) == pytest.approx(math.sqrt(12 * 4.0))
    with pytest.raises(ValueError, match="same shape"):
        relative_l2_error(torch.zeros(3, 4), torch.zeros(4, 3))
