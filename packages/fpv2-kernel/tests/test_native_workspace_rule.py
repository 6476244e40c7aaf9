"""The binding's rule for asking the library for a workspace (split-KV, the kept-block work order), on the host."""

from __future__ import annotations

import pytest

from fpv2.kernel._native.api import DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES, workspace_may_be_used

H200_SMS = 132


def _rule(num_requests, total_q, max_q, max_k, *, splits="", work_order="", persistent="", group=4, kv_heads=8):
    return workspace_may_be_used(
        num_requests=num_requests, total_q=total_q, max_seqlen_q=max_q, max_seqlen_k=max_k, group=group,
        num_kv_heads=kv_heads, sms=H200_SMS, splits=splits, work_order=work_order, persistent=persistent,
    )  # fmt: skip


def test_few_ctas_may_split():
    # 128 queries x 4 heads = 4 tiles x 8 KV heads = 32 CTAs < 132 SMs (a chunk after a prefix).
    assert _rule(1, 128, 128, 131072)
    # 16K: 512 tiles x 8 = 4096 CTAs: no split, and a fresh request is not ordered.
    assert not _rule(1, 16384, 16384, 16384)
    assert not _rule(1, 32768, 32768, 32768, work_order="auto")  # "auto" never orders one request


def test_forced_settings_always_ask():
    assert _rule(1, 32768, 32768, 32768, splits="4")
    assert not _rule(1, 16384, 16384, 16384, splits="1")  # 1 turns splitting off
    assert _rule(1, 32768, 32768, 32768, work_order="1")


def test_the_work_order_can_be_switched_off():
    # Eight requests of uneven lengths after prefixes, 8192 CTAs: "0" asks for no order's workspace.
    assert not _rule(8, 30000, 4096, 131072, work_order="0")


def test_auto_orders_uneven_batches_with_more_ctas_than_sms():
    assert _rule(8, 30000, 4096, 4096, work_order="auto")  # query lengths differ
    assert _rule(8, 8 * 4096, 4096, 131072, work_order="auto")  # equal chunks, one with a cached prefix
    assert not _rule(8, 8 * 4096, 4096, 4096, work_order="auto")  # equal fresh requests
    # Uneven but only 132 CTAs (33 tiles x 4 requests, one KV head): one wave, nothing to order.
    assert not _rule(4, 3000, 1056, 1056, work_order="auto", kv_heads=1)


def test_the_dynamic_tile_queue_asks_for_its_counter():
    # One 32K request (8192 CTAs) asks for nothing, except with the persistent CTAs' tile queue.
    assert _rule(1, 32768, 32768, 32768, persistent="dynamic")
    assert not _rule(1, 32768, 32768, 32768, persistent="1")  # the static snake order needs no workspace
    assert not _rule(1, 32768, 32768, 32768, persistent="0")


def test_long_requests_and_chunks_after_prefixes_ask_for_the_default_schedule():
    # At 32 / 8 heads a request of L tokens has L / 4 CTAs: from 24K (6144) the tile queue in the work order.
    assert DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES == 6144
    for length in (24576, 32768, 131072):
        assert _rule(1, length, length, length)
        assert _rule(4, 4 * length, length, length)
    assert not _rule(1, 24576 - 32, 24576 - 32, 24576 - 32)  # one tile per KV head short
    assert not _rule(4, 4 * 8192, 8192, 8192)  # 8192 CTAs of short fresh requests
    # A chunk after a cached prefix: the work order, once the call has more CTAs than SMs.
    assert _rule(1, 2048, 2048, 131072)  # 512 CTAs
    assert _rule(4, 4 * 8192, 8192, 65536)
    assert not _rule(1, 1056, 1056, 131072, kv_heads=4)  # 33 tiles x 4 KV heads = 132 CTAs: one wave, no split


@pytest.mark.parametrize(("persistent", "work_order"), [("0", ""), ("1", ""), ("", "0"), ("", "auto")])
def test_the_default_schedule_steps_aside_for_explicit_settings(persistent, work_order):
    # Either switch set chooses the schedule itself: no default queue, no default order.
    assert not _rule(1, 131072, 131072, 131072, persistent=persistent, work_order=work_order)
    assert not _rule(1, 16384, 16384, 131072, persistent=persistent, work_order=work_order)
