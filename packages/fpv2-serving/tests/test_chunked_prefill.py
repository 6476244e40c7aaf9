"""Chunked prefill: chunk-aware selection keeps the unchunked selection, incremental pooling is exact."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from fpv2.index import SelectionConfig, build_block_index
from fpv2.index.reference.forced import dense_tile_mask
from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.contracts import cdiv, num_key_blocks, num_query_tiles
from fpv2.kernel.reference.pooling import pool_blocks
from fpv2.kernel.testing import planted_workload
from fpv2.serving.chunked import ChunkedPrefillPipeline, ChunkedPrefillResult
from fpv2.serving.chunked_pooling import pool_chunk
from fpv2.serving.chunked_selection import (
    densify_segments,
    select_chunk_blocks,
    uniform_dense_tail,
    uniform_tail_of_counts,
)
from fpv2.serving.chunked_state import ChunkedPrefillState
from fpv2.serving.pipeline import SparsePrefillPipeline

HQ, HKV, D = 8, 2, 64
GROUP = HQ // HKV
TILE = 128
# Small sinks and windows so that a 4K prompt has blocks to prune; a short-prompt threshold above
# the first chunk's KV and two dense tail tiles, so that naive per-chunk fallbacks are visible.
CONFIG = SelectionConfig(alpha=0.1, sink_tokens=128, window_tokens=128, dense_tail_tiles=2, min_sparse_kv_len=2048)


def make_workload(seqlens_q, seqlens_k=None, *, page_size=16, seed=1):
    return planted_workload(
        seqlens_q,
        seqlens_k,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        page_size=page_size,
        fraction=0.05,
        seed=seed,
        dtype=torch.float32,
    )


def kept_lists(index) -> list[list[int]]:
    """Kept block ids of every segment, decoded from the CSR arrays."""
    offsets = index.offsets.tolist()
    blocks = index.blocks[: offsets[-1]].tolist()
    return [blocks[a:z] for a, z in itertools.pairwise(offsets)]


def by_segment(index, batch) -> dict[tuple[int, int, int], list[int]]:
    """``{(request, kv_head, tile): kept ids}`` following the documented segment order."""
    lists = kept_lists(index)
    out, s = {}, 0
    for b, q_len in enumerate(batch.host.q_lens):
        for h in range(index.num_kv_heads):
            for t in range(num_query_tiles(q_len, index.group, index.tile_size)):
                out[b, h, t] = lists[s]
                s += 1
    assert s == len(lists)
    return out


def chunk_plan(batch: PagedPrefillBatch, chunk: int):
    """Chunks in lockstep: per chunk, ``[(request, begin, length)]`` of the requests that have queries left."""
    q_lens = batch.host.q_lens
    return [
        [(b, i * chunk, min(chunk, n - i * chunk)) for b, n in enumerate(q_lens) if n > i * chunk]
        for i in range(cdiv(max(q_lens), chunk))
    ]


def chunk_inputs(wl, parts):
    """Queries and a validated batch (built independently of the pipeline's helper) for one chunk."""
    host = wl.batch.host
    q = torch.cat([wl.q[host.cu_seqlens_q[b] + a : host.cu_seqlens_q[b] + a + n] for b, a, n in parts])
    cu = torch.tensor([0] + [n for _, _, n in parts], dtype=torch.int32).cumsum(0).to(torch.int32)
    seqlens_k = torch.tensor([host.prefix[b] + a + n for b, a, n in parts], dtype=torch.int32)
    table = wl.batch.page_table[[b for b, _, _ in parts]].contiguous()
    batch = PagedPrefillBatch(cu, seqlens_k, table, wl.batch.page_size, wl.batch.num_pages)
    return q, batch


def chunked_selection(wl, config, chunk, *, strategy="max_threshold"):
    """Chunk-aware selection (pooling + selection, no attention) chunk by chunk: [(parts, batch, index, pooled)]."""
    host = wl.batch.host
    states = [
        ChunkedPrefillState(prompt_len=kv, prefill_start=p, block_size=config.block_size)
        for kv, p in zip(host.seqlens_k, host.prefix)
    ]
    out = []
    for parts in chunk_plan(wl.batch, chunk):
        q, batch = chunk_inputs(wl, parts)
        chunk_states = [states[b] for b, _, _ in parts]
        stats, pooled, _ = pool_chunk(chunk_states, wl.k_cache, None, batch, block_size=config.block_size)
        index, _ = select_chunk_blocks(q, wl.k_cache, batch, stats, chunk_states, config=config, strategy=strategy)
        index.check_compatible(batch, GROUP)
        out.append((parts, batch, index, pooled))
    return out


def assert_restriction_of_unchunked(wl, config, chunk, *, strategy="max_threshold"):
    """Every chunk tile keeps exactly the blocks of the unchunked tile holding the same packed rows."""
    whole = build_block_index(wl.q, wl.k_cache, wl.batch, config=config, strategy=strategy)
    reference = by_segment(whole, wl.batch)
    kept = visible = segments = 0
    chunks = chunked_selection(wl, config, chunk, strategy=strategy)
    for parts, batch, index, _ in chunks:
        got = by_segment(index, batch)
        for (j, h, t), ids in got.items():
            b, begin, _ = parts[j]
            assert begin * GROUP % TILE == 0  # the premise of exactness
            assert ids == reference[b, h, begin * GROUP // TILE + t], (b, h, begin, t)
        kept += index.nnz
        visible += index.visible_pairs(batch)
        segments += len(got)
    assert segments == len(reference)
    assert kept == whole.nnz and visible == whole.visible_pairs(wl.batch)
    return whole, chunks


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def prompt():
    """One 4096-token prompt, 8 query heads over 2 KV heads, d=64, page size 16, fp32, planted."""
    return make_workload([4096])


@pytest.fixture(scope="module")
def unchunked(prompt):
    return SparsePrefillPipeline(CONFIG, backend="reference")(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch)


@pytest.fixture(scope="module")
def aware(prompt):
    pipe = ChunkedPrefillPipeline(CONFIG, backend="reference")
    return pipe.run(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch, chunk_size=1024)


@pytest.fixture(scope="module")
def naive(prompt):
    # The baseline: the plain pipeline on every chunk (no correction: only its selection is compared).
    pipe = ChunkedPrefillPipeline(CONFIG, backend="reference", correction=False, chunk_aware=False)
    return pipe.run(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch, chunk_size=1024)


# ------------------------------------------------------------------- tile-aligned chunks
def test_aligned_chunks_select_exactly_the_unchunked_blocks(prompt, unchunked, aware):
    assert isinstance(aware, ChunkedPrefillResult) and len(aware.chunks) == 4
    reference = by_segment(unchunked.index, prompt.batch)
    tiles_per_chunk = 1024 * GROUP // TILE
    for i, chunk in enumerate(aware.chunks):
        assert chunk.requests == (0,) and chunk.query_rows == ((1024 * i, 1024 * (i + 1)),)
        for (_, h, t), ids in by_segment(chunk.index, chunk.batch).items():
            assert ids == reference[0, h, i * tiles_per_chunk + t]
    # The selection is sparse (else equality would be trivial) and the total density is the unchunked one.
    assert 0.1 < unchunked.index.density(prompt.batch) < 0.6
    assert aware.kept_pairs == unchunked.index.nnz
    assert aware.visible_pairs == unchunked.index.visible_pairs(prompt.batch)
    assert aware.density() == pytest.approx(unchunked.index.density(prompt.batch), abs=0.0)
    # Only the prompt's last two tiles are dense, not the last two of every chunk.
    assert aware.dense_tiles == CONFIG.dense_tail_tiles


def test_aligned_chunk_outputs_equal_unchunked_rows(prompt, unchunked, aware):
    torch.testing.assert_close(aware.out, unchunked.out, rtol=1e-6, atol=1e-6)
    for i, chunk in enumerate(aware.chunks):
        torch.testing.assert_close(chunk.out, unchunked.out[1024 * i : 1024 * (i + 1)], rtol=1e-6, atol=1e-6)


def test_naive_per_chunk_selection_is_denser(prompt, unchunked, aware, naive):
    assert naive.density() > aware.density() + 0.02
    # The first chunk's KV (1024) is below min_sparse_kv_len (2048): the naive rule keeps it all.
    first = naive.chunks[0]
    assert first.index.nnz == first.visible_pairs
    assert aware.chunks[0].kept_pairs < aware.chunks[0].visible_pairs
    # Naive: 32 tiles of the short first chunk + 2 tail tiles of each later chunk.
    assert naive.dense_tiles == 1024 * GROUP // TILE + 3 * CONFIG.dense_tail_tiles
    # And it re-pools the whole prefix at every chunk, where the chunk-aware run pools each block once.
    assert naive.pooled_blocks == sum(num_key_blocks(1024 * (i + 1)) for i in range(4))
    assert aware.pooled_blocks == num_key_blocks(4096)
    # Both runs compute valid outputs; the naive one differs from unchunked where it kept more blocks.
    assert (naive.out - unchunked.out).abs().max() > 1e-4


def test_timings_per_chunk(aware):
    totals = aware.stage_totals()
    for chunk in aware.chunks:
        t = chunk.timings
        assert min(t.index_ms, t.correction_ms, t.attention_ms) >= 0.0
    assert totals.total_ms == pytest.approx(sum(c.timings.total_ms for c in aware.chunks))


def test_prompt_length_not_a_multiple_of_the_chunk():
    wl = make_workload([4000], seed=2)  # chunks 1024, 1024, 1024, 928
    whole, _ = assert_restriction_of_unchunked(wl, CONFIG, 1024)
    assert whole.density(wl.batch) < 0.7


def test_chunk_boundaries_not_block_aligned(prompt):
    # 1056 * g = 33 tiles: tile-aligned, but chunks end 32 tokens into a block.
    _, chunks = assert_restriction_of_unchunked(prompt, CONFIG, 1056)
    pooled = [p for *_, p in chunks]
    # Each chunk pools its new blocks plus the partial block the previous chunk ended in.
    assert pooled == [9, 9, 9, 8] and sum(pooled) == num_key_blocks(4096) + 3


def test_cached_prefix_not_block_aligned_and_two_requests():
    # Request 0: 3000 queries over a 1096-token cached prefix; request 1: 2000 queries, no prefix.
    wl = make_workload([3000, 2000], [4096, 2000], seed=3)
    assert_restriction_of_unchunked(wl, CONFIG, 1024)


def test_dense_strategy_and_single_chunk_match_unchunked(prompt):
    assert_restriction_of_unchunked(prompt, CONFIG, 1024, strategy="dense")
    assert_restriction_of_unchunked(prompt, CONFIG, 8192)  # one chunk: the unchunked call itself


def test_two_request_pipeline_run_equals_unchunked():
    # Request 1 starts over a 520-token prefix (not block aligned); 256-token chunks are tile aligned.
    wl = make_workload([1024, 768], [1024, 1288], page_size=1, seed=4)
    config = dataclasses.replace(CONFIG, min_sparse_kv_len=512)
    whole = SparsePrefillPipeline(config, backend="reference")(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    run = ChunkedPrefillPipeline(config, backend="reference").run(
        wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=256
    )
    assert [c.requests for c in run.chunks] == [(0, 1), (0, 1), (0, 1), (0,)]
    assert run.kept_pairs == whole.index.nnz < whole.index.visible_pairs(wl.batch)
    torch.testing.assert_close(run.out, whole.out, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- misaligned chunks
def test_misaligned_chunks_differ_only_as_documented(prompt, unchunked, naive):
    # 1000 * g % 128 != 0: chunk tiles are not unchunked tiles.
    chunks = chunked_selection(prompt, CONFIG, 1000)
    kept = sum(index.nnz for _, _, index, _ in chunks)
    visible = sum(index.visible_pairs(batch) for _, batch, index, _ in chunks)
    # One extra (partial) tile per chunk boundary, each with its own forced blocks: slightly denser.
    assert visible > unchunked.index.visible_pairs(prompt.batch)
    unchunked_density = unchunked.index.density(prompt.batch)
    assert unchunked_density <= kept / visible < unchunked_density * 1.1
    assert kept / visible < naive.density()
    # The last chunk (96 queries = 3 tiles) is dense where it holds rows of the prompt's two dense
    # tail tiles: its last two tiles.
    parts, last_batch, last_index, _ = chunks[-1]
    assert parts == [(0, 4000, 96)]
    tiles = num_query_tiles(96, GROUP)
    for (_, _h, t), ids in by_segment(last_index, last_batch).items():
        last_pos = 4000 + (min((t + 1) * TILE, 96 * GROUP) - 1) // GROUP
        if t >= tiles - 2:
            assert ids == list(range(last_pos // 128 + 1))
        else:
            assert len(ids) < last_pos // 128 + 1
    # Through the pipeline: pool the earlier chunks, attend the last one. Its tail rows are dense in
    # both runs, so they equal the unchunked output there.
    pipe = ChunkedPrefillPipeline(CONFIG, backend="reference")
    state = pipe.new_state(prompt_len=4096)
    for begin in range(0, 4000, 1000):
        _, batch = chunk_inputs(prompt, [(0, begin, 1000)])
        pool_chunk([state], prompt.k_cache, prompt.v_cache, batch, block_size=128)
    q, batch = chunk_inputs(prompt, parts)
    last = pipe.run_chunk(q, prompt.k_cache, prompt.v_cache, batch, [state])
    assert last.dense_tiles == 2 and last.pooled_blocks == 1  # block 31 again, 4000 % 128 != 0
    assert torch.equal(last.index.offsets, last_index.offsets) and torch.equal(last.index.blocks, last_index.blocks)
    tail_positions = CONFIG.dense_tail_tiles * TILE // GROUP
    torch.testing.assert_close(last.out[-tail_positions:], unchunked.out[-tail_positions:], rtol=1e-6, atol=1e-6)
    # Exactness is per chunk start: 4000 * g is a multiple of 128, so this chunk's first tile is
    # unchunked tile 125 and keeps the same blocks, while the chunks starting at 1000, 2000 and 3000 are shifted.
    reference = by_segment(unchunked.index, prompt.batch)
    for h in range(HKV):
        assert last.index.kept_blocks(0, h, 0) == reference[0, h, 125]
    assert [begin * GROUP % TILE for ((_, begin, _),), *_ in chunks] == [0, 32, 64, 96, 0]


# -------------------------------------------------------------------- incremental pooling
@pytest.mark.parametrize("page_size", [16, 48])  # 48 does not divide the block size: token gather path
def test_incremental_pooling_equals_pooling_from_scratch(page_size):
    wl = make_workload([4096], page_size=page_size, seed=5)
    state = ChunkedPrefillState(prompt_len=4096)
    starts = [0, 1000, 1100, 2048, 3333, 4000]
    ends = [*starts[1:], 4096]
    for begin, end in zip(starts, ends):
        batch = PagedPrefillBatch(
            torch.tensor([0, end - begin], dtype=torch.int32),
            torch.tensor([end], dtype=torch.int32),
            wl.batch.page_table,
            wl.batch.page_size,
            wl.batch.num_pages,
        )
        before = state.pooled_blocks
        stats, pooled, _ = pool_chunk([state], wl.k_cache, wl.v_cache, batch, block_size=128)
        # Only the touched blocks: the partial block the previous chunk ended in, and the new ones.
        assert pooled == state.pooled_blocks - before == cdiv(end, 128) - begin // 128
        scratch = pool_blocks(wl.k_cache, wl.v_cache, batch, block_size=128)
        assert torch.equal(stats.block_lengths, scratch.block_lengths)
        assert torch.equal(stats.block_offsets, scratch.block_offsets)
        torch.testing.assert_close(stats.pooled_k, scratch.pooled_k, rtol=0, atol=1e-6)
        torch.testing.assert_close(stats.pooled_v, scratch.pooled_v, rtol=0, atol=1e-6)
    assert state.pooled_blocks == 32 + sum(1 for s in starts[1:] if s % 128)  # 4 partial blocks re-pooled
    assert state.pooled_blocks < sum(cdiv(e, 128) for e in ends)  # from scratch at every chunk


def test_retried_chunk_pools_its_blocks_again():
    wl = make_workload([2048], page_size=16, seed=6)
    state = ChunkedPrefillState(prompt_len=2048)

    def chunk(begin, end):
        batch = PagedPrefillBatch(
            torch.tensor([0, end - begin], dtype=torch.int32),
            torch.tensor([end], dtype=torch.int32),
            wl.batch.page_table,
            16,
            wl.batch.num_pages,
        )
        return batch, pool_chunk([state], wl.k_cache, None, batch, block_size=128)

    chunk(0, 700)
    chunk(700, 1500)
    batch, (stats, pooled, _) = chunk(700, 1500)  # the same chunk again (e.g. after a failed forward)
    assert pooled == cdiv(1500, 128) - 700 // 128
    torch.testing.assert_close(stats.pooled_k, pool_blocks(wl.k_cache, None, batch).pooled_k, rtol=0, atol=1e-6)
    assert stats.pooled_v is None


# -------------------------------------------------------------------------- dense rules
def test_dense_tile_mask_whole_prompt_rule():
    config = CONFIG
    prompt_len, start = 4096, 0
    state = ChunkedPrefillState(prompt_len=prompt_len, prefill_start=start)
    whole = dense_tile_mask(num_query_tiles(prompt_len, GROUP), prompt_len, config, "cpu")
    per_chunk = torch.cat([state.dense_tile_mask(p, 1024, GROUP, config) for p in range(0, 4096, 1024)])
    assert torch.equal(per_chunk, whole) and int(whole.sum()) == 2
    # A short prompt is dense everywhere, even in chunks whose KV is short too.
    short = ChunkedPrefillState(prompt_len=1500)
    assert bool(short.dense_tile_mask(0, 1024, GROUP, config).all())
    # A chunk tile straddling the start of the dense tail is dense as a whole.
    straddle = state.dense_tile_mask(3000, 1096, GROUP, config)  # 1096 * 4 rows = 34.25 tiles
    dense_rows_from = (num_query_tiles(4096, GROUP) - 2) * TILE
    expected = [(3000 * GROUP + min((t + 1) * TILE, 1096 * GROUP) - 1) >= dense_rows_from for t in range(35)]
    assert straddle.tolist() == expected and sum(expected) == 3
    # Without prompt_len the per-chunk rule applies (any chunk may be the last).
    unknown = ChunkedPrefillState()
    assert torch.equal(unknown.dense_tile_mask(1024, 1024, GROUP, config), dense_tile_mask(32, 2048, config, "cpu"))


def _row_rule_mask(state, prefix, q_len, group, config):
    """The whole-prompt rule as the spec states it, tile by tile in packed rows (no shortcut)."""
    tiles = num_query_tiles(q_len, group, config.tile_size)
    if state.prompt_len is None:
        return dense_tile_mask(tiles, prefix + q_len, config, "cpu").tolist()
    if state.prompt_len < config.min_sparse_kv_len:
        return [True] * tiles
    prompt_tiles = cdiv((state.prompt_len - state.prefill_start) * group, config.tile_size)
    dense_from_row = max(prompt_tiles - config.dense_tail_tiles, 0) * config.tile_size
    first_row = (prefix - state.prefill_start) * group
    return [first_row + min((t + 1) * config.tile_size, q_len * group) - 1 >= dense_from_row for t in range(tiles)]


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("tail", [0, 1, 3])
def test_dense_tile_count_is_the_row_rule_on_every_chunk(group, tail):
    config = dataclasses.replace(CONFIG, dense_tail_tiles=tail, min_sparse_kv_len=2000)
    states = [
        ChunkedPrefillState(prompt_len=4100, prefill_start=0),
        ChunkedPrefillState(prompt_len=4100, prefill_start=333),
        ChunkedPrefillState(prompt_len=1500),  # short: every tile dense
        ChunkedPrefillState(),  # unknown prompt: the per-chunk rule
    ]
    for state in states:
        end = state.prompt_len or 4100
        pairs = list(itertools.product(range(state.prefill_start, end, 97), (1, 31, 64, 400, 1096)))
        pairs += [(1600, 400), (1601, 400), (1599, 400)]  # KV at, past and short of min_sparse_kv_len
        for prefix, q_len in pairs:
            if prefix < state.prefill_start or prefix + q_len > end:
                continue
            expected = _row_rule_mask(state, prefix, q_len, group, config)
            count = state.dense_tile_count(prefix, q_len, group, config)
            assert expected == [t >= len(expected) - count for t in range(len(expected))], (state, prefix, q_len)
            assert state.dense_tile_mask(prefix, q_len, group, config).tolist() == expected


def test_uniform_tail_of_counts_matches_the_mask_rule():
    for counts_tiles in itertools.product([(0, 8), (2, 8), (8, 8), (1, 1), (0, 5), (5, 5), (2, 5), (0, 0)], repeat=2):
        counts = [c for c, _ in counts_tiles]
        tiles = [t for _, t in counts_tiles]
        masks = [torch.arange(t) >= t - c for c, t in counts_tiles]
        assert uniform_tail_of_counts(counts, tiles) == uniform_dense_tail(masks), counts_tiles


def test_densify_segments_keeps_other_tiles():
    wl = make_workload([1024], page_size=16, seed=7)
    config = dataclasses.replace(CONFIG, dense_tail_tiles=0, min_sparse_kv_len=0)
    index = build_block_index(wl.q, wl.k_cache, wl.batch, config=config)
    mask = torch.zeros(num_query_tiles(1024, GROUP), dtype=torch.bool)
    mask[[3, 17, 31]] = True
    out = densify_segments(index, wl.batch, [mask], num_kv_heads=HKV, group=GROUP, tile_size=TILE, block_size=128)
    out.validate_values()
    before, after = by_segment(index, wl.batch), by_segment(out, wl.batch)
    for (b, h, t), ids in after.items():
        if mask[t]:
            last_pos = (min((t + 1) * TILE, 1024 * GROUP) - 1) // GROUP
            assert ids == list(range(last_pos // 128 + 1))
        else:
            assert ids == before[b, h, t]


# ------------------------------------------------------------------------------ bad input
def test_bad_inputs_are_refused(prompt):
    with pytest.raises(TypeError, match="prompt_len"):
        ChunkedPrefillState(prompt_len=4096.0)
    with pytest.raises(ValueError, match="prefill_start"):
        ChunkedPrefillState(prompt_len=100, prefill_start=200)
    with pytest.raises(ValueError, match="block_size"):
        ChunkedPrefillState(block_size=100)
    state = ChunkedPrefillState(prompt_len=2048, prefill_start=512)
    with pytest.raises(ValueError, match="prefill_start"):
        state.check_chunk(256, 256)
    with pytest.raises(ValueError, match="prompt_len"):
        state.check_chunk(2000, 100)
    pipe = ChunkedPrefillPipeline(CONFIG, backend="reference")
    with pytest.raises(ValueError, match="chunk_size"):
        pipe.run(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        pipe.run(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch, chunk_size="1024")
    with pytest.raises(TypeError, match="chunk_aware"):
        ChunkedPrefillPipeline(CONFIG, chunk_aware=1)
    with pytest.raises(ValueError, match="states"):
        pipe.run_chunk(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch)
    with pytest.raises(ValueError, match="one ChunkedPrefillState per request"):
        pipe.run_chunk(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch, [])
    with pytest.raises(TypeError, match=r"states\[0\]"):
        pipe.run_chunk(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch, [object()])
    with pytest.raises(ValueError, match="block"):
        pipe.run_chunk(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch, [ChunkedPrefillState(block_size=64)])
    with pytest.raises(ValueError, match="prompt_len"):  # the state says the prompt is shorter than this chunk
        pipe.run_chunk(prompt.q, prompt.k_cache, prompt.v_cache, prompt.batch, [ChunkedPrefillState(prompt_len=10)])
    with pytest.raises(ValueError, match="q must"):
        pipe.run_chunk(prompt.q[:-1], prompt.k_cache, prompt.v_cache, prompt.batch, [pipe.new_state()])


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_chunked_selection_equals_unchunked_on_gpu():
    wl = planted_workload(
        [32768], num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, dtype=torch.bfloat16, device="cuda"
    )
    config = SelectionConfig()
    whole = SparsePrefillPipeline(config)(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    run = ChunkedPrefillPipeline(config).run(wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=8192)
    naive = ChunkedPrefillPipeline(config, chunk_aware=False).run(
        wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=8192
    )
    reference = by_segment(whole.index, wl.batch)
    tiles_per_chunk = 8192 * 4 // TILE
    for i, chunk in enumerate(run.chunks):
        for (_, h, t), ids in by_segment(chunk.index, chunk.batch).items():
            assert ids == reference[0, h, i * tiles_per_chunk + t]
    assert run.kept_pairs == whole.index.nnz
    assert naive.density() > run.density()
    err = float((run.out.float() - whole.out.float()).norm() / whole.out.float().norm())
    assert err < 1e-2


# ------------------------------------------------------- Triton index (interpreter or GPU)
def _triton_ready() -> bool:
    try:
        from fpv2.index.triton import interpreter_enabled
    except ImportError:
        return False
    return interpreter_enabled() or torch.cuda.is_available()


@pytest.mark.skipif(not _triton_ready(), reason="needs Triton with a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_triton_pooling_and_selection_compose_chunk_by_chunk():
    from fpv2.index.triton import interpreter_enabled, pool_blocks_triton, select_blocks_triton

    device = "cpu" if interpreter_enabled() else "cuda"

    class TritonSelection:
        """The fused Triton selection as a strategy object (CPU inputs run under the interpreter)."""

        name = "triton_max_threshold"

        def select(self, q, batch, statistics, *, config, q_descale=None, k_descale=None):
            return select_blocks_triton(q, batch, statistics, config=config, q_descale=q_descale, k_descale=k_descale)

    wl = planted_workload(
        [1024],
        [1096],  # a 72-token cached prefix: chunks end mid-block
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        page_size=8,
        fraction=0.05,
        seed=8,
        dtype=torch.float32,
        device=device,
    )
    config = dataclasses.replace(CONFIG, min_sparse_kv_len=512)
    strategy = TritonSelection()
    whole_stats = pool_blocks_triton(wl.k_cache, None, wl.batch)
    whole = build_block_index(wl.q, wl.k_cache, wl.batch, config=config, strategy=strategy, statistics=whole_stats)
    reference = by_segment(whole, wl.batch)
    state = ChunkedPrefillState(prompt_len=1096, prefill_start=72)
    kept = 0
    for begin in range(0, 1024, 256):
        q = wl.q[begin : begin + 256]
        batch = PagedPrefillBatch(
            torch.tensor([0, 256], dtype=torch.int32, device=device),
            torch.tensor([72 + begin + 256], dtype=torch.int32, device=device),
            wl.batch.page_table,
            8,
            wl.batch.num_pages,
        )
        stats, pooled, _ = pool_chunk([state], wl.k_cache, None, batch, block_size=128, use_triton=True)
        assert pooled == cdiv(72 + begin + 256, 128) - (72 + begin) // 128
        scratch = pool_blocks_triton(wl.k_cache, None, batch)
        torch.testing.assert_close(stats.pooled_k, scratch.pooled_k, rtol=0, atol=1e-6)
        index, dense = select_chunk_blocks(q, wl.k_cache, batch, stats, [state], config=config, strategy=strategy)
        for (_, h, t), ids in by_segment(index, batch).items():
            assert ids == reference[0, h, begin * 2 // TILE + t]
        assert dense == (CONFIG.dense_tail_tiles if begin == 768 else 0)  # only the prompt's last tiles
        kept += index.nnz
    assert kept == whole.nnz < whole.visible_pairs(wl.batch)
