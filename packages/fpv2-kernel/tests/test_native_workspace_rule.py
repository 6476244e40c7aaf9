"""The binding's rule for asking the library for a workspace (split-KV, the kept-block work order), on the host."""

from __future__ import annotations

import pytest

from fpv2.kernel._native.api import workspace_may_be_used

H200_SMS = 132


def _rule(num_requests, total_q, max_q, max_k, *, splits="", work_order="", persistent="", group=4, kv_heads=8):
    return workspace_may_be_used(
        num_requests=num_requests, total_q=total_q, max_seqlen_q=max_q, max_seqlen_k=max_k, group=group,
        num_kv_heads=kv_heads, sms=H200_SMS, splits=splits, work_order=work_order, persistent=persistent,
    )  # fmt: skip


def test_few_ctas_may_split():
    # 128 queries x 4 heads = 4 tiles x 8 KV heads = 32 CTAs < 132 SMs (a chunk after a prefix).
    assert _rule(1, 128, 128, 131072)
    # 32K: 1024 tiles x 8 = 8192 CTAs: no split, and one request is never ordered.
    assert not _rule(1, 32768, 32768, 32768)
    assert not _rule(1, 32768, 32768, 32768, work_order="auto")


def test_forced_settings_always_ask():
    assert _rule(1, 32768, 32768, 32768, splits="4")
    assert not _rule(1, 32768, 32768, 32768, splits="1")  # 1 turns splitting off
    assert _rule(1, 32768, 32768, 32768, work_order="1")


@pytest.mark.parametrize("work_order", ["", "0"])
def test_the_work_order_is_opt_in(work_order):
    # Eight requests of uneven lengths, 8192 CTAs: only "auto" or "1" asks for the order's workspace.
    assert not _rule(8, 30000, 4096, 131072, work_order=work_order)


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
