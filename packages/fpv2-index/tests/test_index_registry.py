"""Strategy registry: built-ins, run-time registration, entry-point plugins and error messages."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from index_testlib import kept_lists, make_case

from fpv2.index import (
    ENTRY_POINT_GROUP,
    DenseStrategy,
    MaxThresholdStrategy,
    SelectionConfig,
    SelectionStrategy,
    available_strategies,
    build_block_index,
    get_strategy,
    register_strategy,
    unregister_strategy,
)
from fpv2.index.reference import assemble_block_index


def test_builtins():
    assert {"dense", "max_threshold"} <= set(available_strategies())
    assert isinstance(get_strategy("max_threshold"), MaxThresholdStrategy)
    assert isinstance(get_strategy("dense"), DenseStrategy)
    assert get_strategy("dense").name == "dense" and isinstance(get_strategy("dense"), SelectionStrategy)


def test_unknown_strategy_lists_the_available_ones():
    expected = r"unknown selection strategy 'no_such_strategy'; available strategies: .*dense.*max_threshold.*top_k"
    with pytest.raises(ValueError, match=expected):
        get_strategy("no_such_strategy")
    case = make_case([4], [4], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=1)
    with pytest.raises(ValueError, match="unknown selection strategy 'nope'"):
        build_block_index(case.q, case.k_cache, case.batch, strategy="nope")
    with pytest.raises(TypeError, match="strategy name must be a non-empty str"):
        get_strategy("")


class FirstBlockOnly:
    """A custom strategy: block 0 and the diagonal block of every tile's last row."""

    name = "first_block_only"

    def select(self, q, batch, statistics, *, config, q_descale=None, k_descale=None):
        host, counts, ids = batch.host, [], []
        group = q.shape[1] // statistics.num_kv_heads
        for q_len, prefix in zip(host.q_lens, host.prefix):
            ntiles = -(-q_len * group // config.tile_size)
            last = [
                (prefix + (min((t + 1) * config.tile_size, q_len * group) - 1) // group) // config.block_size
                for t in range(ntiles)
            ]
            for _ in range(statistics.num_kv_heads):
                for j in last:
                    blocks = sorted({0, j})
                    counts.append(torch.tensor([len(blocks)], dtype=torch.int32))
                    ids.append(torch.tensor(blocks, dtype=torch.int32))
        return assemble_block_index(
            counts,
            ids,
            batch,
            group=group,
            num_kv_heads=statistics.num_kv_heads,
            tile_size=config.tile_size,
            block_size=config.block_size,
        )


def test_custom_strategy_registered_and_used_by_name():
    register_strategy("first_block_only", FirstBlockOnly)
    try:
        assert "first_block_only" in available_strategies()
        assert isinstance(get_strategy("first_block_only"), FirstBlockOnly)
        case = make_case([300], [300], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
        index = build_block_index(
            case.q, case.k_cache, case.batch, strategy="first_block_only", config=SelectionConfig(block_size=64)
        )
        # g = 2: a tile of 128 rows is 64 positions, so tile t ends in block t (blocks of 64 tokens).
        assert kept_lists(index)[:3] == [[0], [0, 1], [0, 2]]
        with pytest.raises(ValueError, match="registered already"):
            register_strategy("first_block_only", FirstBlockOnly)
        register_strategy("first_block_only", FirstBlockOnly(), replace=True)
    finally:
        unregister_strategy("first_block_only")
    assert "first_block_only" not in available_strategies()


def test_decorator_registration_and_protocol_check():
    @register_strategy("decorated_dense")
    class Decorated(DenseStrategy):
        name = "decorated_dense"

    try:
        assert isinstance(get_strategy("decorated_dense"), Decorated)
    finally:
        unregister_strategy("decorated_dense")
    with pytest.raises(TypeError, match="not a SelectionStrategy"):
        register_strategy("broken", object())
    assert "broken" not in available_strategies()


def fake_entry_points(*entries):
    eps = [importlib.metadata.EntryPoint(name=n, value=v, group=ENTRY_POINT_GROUP) for n, v in entries]

    def entry_points(**params):
        assert params == {"group": ENTRY_POINT_GROUP}
        return importlib.metadata.EntryPoints(eps)

    return entry_points


def test_entry_point_discovery(monkeypatch):
    monkeypatch.setattr(
        importlib.metadata,
        "entry_points",
        fake_entry_points(
            ("plugin_dense", "fpv2.index.strategies.dense:DenseStrategy"),
            ("plugin_broken", "fpv2_no_such_module:Strategy"),
            ("plugin_not_a_strategy", "math:pi"),
            ("dense", "math:pi"),  # cannot shadow a built-in
        ),
    )
    try:
        names = available_strategies()
        assert {"plugin_dense", "plugin_broken", "plugin_not_a_strategy", "dense", "max_threshold"} <= set(names)
        assert isinstance(get_strategy("plugin_dense"), DenseStrategy)
        assert isinstance(get_strategy("dense"), DenseStrategy)
        with pytest.raises(ImportError, match="'plugin_broken' from entry point 'fpv2_no_such_module:Strategy'"):
            get_strategy("plugin_broken")
        with pytest.raises(
            TypeError, match="entry point 'plugin_not_a_strategy' = 'math:pi' is not a SelectionStrategy"
        ):
            get_strategy("plugin_not_a_strategy")
        case = make_case([40], [100], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=16)
        index = build_block_index(case.q, case.k_cache, case.batch, strategy="plugin_dense")
        assert index.density(case.batch) == 1.0
    finally:
        unregister_strategy("plugin_dense")
    monkeypatch.undo()
    assert "plugin_dense" not in available_strategies()
