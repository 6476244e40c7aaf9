"""SelectionConfig defaults and validation."""

from __future__ import annotations

import math

import pytest

from fpv2.index import SelectionConfig


def test_defaults_match_the_paper():
    c = SelectionConfig()
    assert (c.alpha, c.block_size, c.tile_size, c.sink_tokens, c.window_tokens) == (0.1, 128, 128, 256, 512)
    assert (c.dense_tail_tiles, c.min_sparse_kv_len, c.probe_stride, c.softmax_scale) == (1, 8192, 1, None)
    assert c.scale_for(128) == pytest.approx(1 / math.sqrt(128))
    assert SelectionConfig(softmax_scale=0.5).scale_for(128) == 0.5


def test_frozen():
    with pytest.raises(AttributeError):
        SelectionConfig().alpha = 0.2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("alpha", 0.0, ValueError, r"alpha must lie in \(0, 1\], got 0.0"),
        ("alpha", 1.5, ValueError, r"alpha must lie in \(0, 1\], got 1.5"),
        ("alpha", math.nan, ValueError, r"alpha must lie in \(0, 1\], got nan"),
        ("alpha", "0.1", TypeError, "alpha must be a float"),
        ("block_size", 96, ValueError, "block_size must be a power of two, got 96"),
        ("block_size", 0, ValueError, "block_size must be >= 1, got 0"),
        ("tile_size", 100, ValueError, "tile_size must be a power of two, got 100"),
        ("tile_size", 64.0, TypeError, "tile_size must be an int"),
        ("sink_tokens", -1, ValueError, "sink_tokens must be >= 0, got -1"),
        ("window_tokens", -5, ValueError, "window_tokens must be >= 0, got -5"),
        ("dense_tail_tiles", -1, ValueError, "dense_tail_tiles must be >= 0, got -1"),
        ("min_sparse_kv_len", -1, ValueError, "min_sparse_kv_len must be >= 0, got -1"),
        ("probe_stride", 0, ValueError, "probe_stride must be >= 1, got 0"),
        ("probe_stride", True, TypeError, "probe_stride must be an int"),
        ("softmax_scale", -1.0, ValueError, "softmax_scale must be positive and finite, got -1.0"),
        ("softmax_scale", math.inf, ValueError, "softmax_scale must be positive and finite"),
    ],
)
def test_validation_names_field_and_value(field, value, error, match):
    with pytest.raises(error, match=f"SelectionConfig.{match}"):
        SelectionConfig(**{field: value})


def test_edge_values_accepted():
    c = SelectionConfig(alpha=1, block_size=1, tile_size=1, sink_tokens=0, window_tokens=0, dense_tail_tiles=0)
    assert c.alpha == 1 and c.window_tokens == 0
