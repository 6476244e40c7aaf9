"""PackGQA tile geometry and the planted workload generator."""

from __future__ import annotations

import pytest
import torch

from fpv2.kernel.contracts import num_key_blocks, num_query_tiles, tile_span
from fpv2.kernel.reference.paged import gather_kv
from fpv2.kernel.reference.pooling import pool_request
from fpv2.kernel.testing import planted_workload


def test_tile_span_limits():
    # g=4: tile 1 holds packed rows 128..255 = positions 32..63; prefix 100 -> absolute 132..163
    span = tile_span(1, q_len=200, prefix=100, group=4)
    assert (span.row_begin, span.row_end, span.p_first, span.p_last) == (128, 256, 32, 63)
    assert span.last_visible_block == 163 // 128 == 1
    assert span.num_scored_blocks == 164 // 128 == 1
    assert span.num_correctable_blocks == 132 // 128 == 1
    last = tile_span(num_query_tiles(200, 4) - 1, q_len=200, prefix=100, group=4)
    assert last.row_end == 800 and last.p_last == 199
    with pytest.raises(ValueError, match="outside the 7 tiles"):
        tile_span(7, q_len=200, prefix=100, group=4)


def test_tile_splits_group_when_g_does_not_divide_128():
    span = tile_span(0, q_len=100, prefix=0, group=7)
    assert span.p_first == 0 and span.p_last == 127 // 7
    assert tile_span(1, q_len=100, prefix=0, group=7).p_first == 128 // 7


def test_counts():
    assert num_query_tiles(0, 8) == 0 and num_query_tiles(16, 8) == 1 and num_query_tiles(17, 8) == 2
    assert num_key_blocks(0) == 0 and num_key_blocks(129) == 2


def test_pool_request_tail_aware():
    tokens = torch.arange(10, dtype=torch.float32).reshape(10, 1, 1).expand(10, 2, 3)
    pooled, lengths = pool_request(tokens, block_size=4)
    assert lengths.tolist() == [4, 4, 2]
    assert pooled[:, 0, 0].tolist() == [1.5, 5.5, 8.5]  # tail block averages its 2 real tokens


def test_planted_workload_plants_margin_and_is_reproducible():
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32, seed=3)
    w = planted_workload([512], [1024], **kw)
    again = planted_workload([512], [1024], **kw)
    assert torch.equal(w.q, again.q) and torch.equal(w.k_cache, again.k_cache)
    assert not torch.equal(w.batch.page_table[0, :64], torch.arange(64, dtype=torch.int32))  # pages shuffled
    keys = gather_kv(w.k_cache, w.batch, 0)
    planted = w.planted_blocks[0]
    assert planted.shape == (2, 8) and planted.sum() >= 2
    # mean logit of the head group's queries on planted blocks exceeds the rest by about the margin (7)
    q = w.q[:, 0:2].mean(dim=1)
    logits = (q @ keys[:, 0].T) / 8.0
    token_planted = planted[0].repeat_interleave(128)
    gap = logits[:, token_planted].mean() - logits[:, ~token_planted].mean()
    assert 5.0 < float(gap) < 9.0
