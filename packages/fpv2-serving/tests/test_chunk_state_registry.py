"""The per-request, per-layer chunk states an engine adapter keeps between forwards (CPU)."""

from __future__ import annotations

import pytest
import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.chunk_state_registry import ChunkRequest, ChunkStateRegistry
from fpv2.serving.chunked import ChunkedPrefillPipeline
from fpv2.serving.chunked_pooling import batch_from_host

LAYERS = (0, 1)


def fill(state, kv_len: int, heads: int = 2, dim: int = 8) -> None:
    """Give a state pooled rows up to ``kv_len`` tokens, as a chunk's pooling would."""
    blocks = -(-kv_len // state.block_size)
    first = state.first_touched_block(kv_len)
    n = blocks - first
    lengths = torch.full((n,), state.block_size, dtype=torch.int32)
    state.store(first, torch.zeros(n, heads, dim), torch.zeros(n, heads, dim), lengths, kv_len)


def test_a_chunked_prompt_resumes_its_state_per_layer_and_releases_it_at_its_last_chunk():
    registry = ChunkStateRegistry(block_size=64)
    chunks = [ChunkRequest("a", p, 256, 768) for p in (0, 256, 512)]
    seen = {layer: [] for layer in LAYERS}
    for i, request in enumerate(chunks):
        assert registry.begin_forward([request])  # every chunk of a chunked prompt takes the chunk-aware path
        for layer in LAYERS:
            (state,) = registry.states_for(layer, [request])
            assert (state.prompt_len, state.prefill_start) == (768, 0)
            fill(state, request.prefix + request.q_len)
            seen[layer].append(state)
        assert len(registry) == (2 if i < 2 else 0)
    for layer in LAYERS:
        assert seen[layer][0] is seen[layer][1] is seen[layer][2]
    assert seen[0][0] is not seen[1][0]
    c = registry.counters
    assert (c.created, c.resumed, c.finished, c.replaced, c.evicted) == (2, 4, 2, 0, 0)
    assert registry.requests() == () and registry.held_bytes == 0


def test_a_prompt_in_one_forward_needs_no_chunk_aware_path_and_holds_nothing():
    registry = ChunkStateRegistry()
    requests = [ChunkRequest("a", 0, 1000, 1000), ChunkRequest("b", 300, 1, 301)]  # a prompt, a decode row
    assert not registry.begin_forward(requests)
    states = registry.states_for(0, requests)
    assert [(s.prompt_len, s.prefill_start) for s in states] == [(1000, 0), (301, 300)]
    assert len(registry) == 0


def test_a_forward_beside_a_chunked_prompt_gives_the_others_transient_states():
    registry = ChunkStateRegistry(block_size=64)
    first = [ChunkRequest("long", 0, 512, 2048), ChunkRequest("short", 0, 100, 100)]
    assert registry.begin_forward(first)
    registry.states_for(0, first)
    assert registry.requests() == ("long",)
    later = [ChunkRequest("new", 0, 64, 64), ChunkRequest("long", 512, 512, 2048)]
    assert registry.begin_forward(later)  # held states make it chunk-aware even with no new partial chunk
    new_state, long_state = registry.states_for(0, later)
    assert registry.counters.resumed == 1 and new_state.prompt_len == 64
    assert registry.requests() == ("long",) and long_state.prefill_start == 0


@pytest.mark.parametrize(
    "changed",
    [
        ChunkRequest("a", 512, 256, 4096),  # another prompt length: the id was reused
        ChunkRequest("a", 0, 256, 1024),  # back before the prefill's start: recomputed after preemption
    ],
)
def test_a_state_that_no_longer_matches_its_request_is_replaced(changed):
    registry = ChunkStateRegistry()
    start = ChunkRequest("a", 256, 256, 1024)  # a prefill that started after a cached prefix of 256
    registry.begin_forward([start])
    (old,) = registry.states_for(0, [start])
    registry.begin_forward([changed])
    (new,) = registry.states_for(0, [changed])
    assert new is not old and registry.counters.replaced == 1
    assert (new.prompt_len, new.prefill_start) == (changed.prompt_len, changed.prefix)


def test_a_retried_chunk_resumes_its_state():
    registry = ChunkStateRegistry()
    request = ChunkRequest("a", 0, 256, 1024)
    for _ in range(2):
        registry.begin_forward([request])
        (state,) = registry.states_for(0, [request])
    assert registry.counters.resumed == 1 and registry.counters.replaced == 0
    assert state.first_touched_block(0) == 0  # the chunk pools its blocks again


def test_idle_states_are_dropped_least_recently_used_first_within_the_budget():
    per_request = 2 * (2 * 1024 * 2 * 8 * 4) + 2 * 1024 * 4  # two layers of pooled K/V (fp32) and lengths
    registry = ChunkStateRegistry(budget_bytes=2 * per_request, block_size=64)
    for key in ("a", "b", "c"):
        request = ChunkRequest(key, 0, 64, 1024 * 64)
        registry.begin_forward([request])
        for layer in LAYERS:
            (state,) = registry.states_for(layer, [request])
            fill(state, 64)
    assert registry.held_bytes == 3 * per_request
    assert registry.requests() == ("a", "b", "c")  # over budget, but "c" was in the forward that filled it
    registry.begin_forward([ChunkRequest("b", 64, 64, 1024 * 64)])
    assert registry.requests() == ("c", "b")  # "a" idle and least recently used: dropped
    assert registry.counters.evicted == 2 and registry.held_bytes == 2 * per_request
    tight = ChunkStateRegistry(budget_bytes=0, block_size=64)
    request = ChunkRequest("x", 0, 64, 4096)
    tight.begin_forward([request])
    fill(tight.states_for(0, [request])[0], 64)
    tight.begin_forward([ChunkRequest("x", 64, 64, 4096)])
    assert tight.requests() == ("x",)  # states the forward uses are never dropped
    tight.begin_forward([ChunkRequest("y", 0, 10, 10)])
    assert tight.requests() == ()
    registry.release("c")
    assert registry.requests() == ("b",)
    registry.clear()
    assert len(registry) == 0


def test_bad_requests_and_options_are_refused():
    with pytest.raises(ValueError, match="past its prompt_len=100"):
        ChunkRequest("a", 90, 20, 100)
    with pytest.raises(ValueError, match="ChunkRequest.q_len"):
        ChunkRequest("a", 0, -1, None)
    with pytest.raises(ValueError, match="appears twice"):
        ChunkStateRegistry().begin_forward([ChunkRequest("a", 0, 1, 1), ChunkRequest("a", 0, 1, 1)])
    with pytest.raises(TypeError, match="budget_bytes"):
        ChunkStateRegistry(budget_bytes=1.5)
    with pytest.raises(ValueError, match="block_size"):
        ChunkStateRegistry(block_size=0)


def test_an_engine_driving_the_registry_gets_the_chunked_pipelines_output():
    """Two layers, a prompt in three forwards beside a one-forward request: the registry's states give each
    layer the outputs of ChunkedPrefillPipeline.run (its own states) and pool each block once."""
    config = SelectionConfig(sink_tokens=64, window_tokens=64, min_sparse_kv_len=0)
    wl = planted_workload([1536], num_q_heads=4, num_kv_heads=2, head_dim=64, fraction=0.1, seed=3)
    pipeline = ChunkedPrefillPipeline(config, backend="reference", carry_tile_pages=False)
    expected = pipeline.run(wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=512)
    registry = ChunkStateRegistry(block_size=config.block_size)
    pooled = 0
    for i, begin in enumerate((0, 512, 1024)):
        request = ChunkRequest("r", begin, 512, 1536)
        assert registry.begin_forward([request])
        batch = batch_from_host(
            [512], [begin + 512], wl.batch.page_table, page_size=wl.batch.page_size, num_pages=wl.batch.num_pages
        )
        for layer in LAYERS:
            chunk = pipeline.run_chunk(
                wl.q[begin : begin + 512], wl.k_cache, wl.v_cache, batch, registry.states_for(layer, [request])
            )
            torch.testing.assert_close(chunk.out, expected.chunks[i].out, rtol=0, atol=0)
            pooled += chunk.pooled_blocks
    assert pooled == len(LAYERS) * expected.pooled_blocks
    assert len(registry) == 0
