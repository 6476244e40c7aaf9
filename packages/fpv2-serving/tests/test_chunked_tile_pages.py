"""The chunk-aware pipeline keeps a request's K/V in tile pages across its chunks, copying only what each adds.

CPU runs use the tile copy under the Triton interpreter (``TRITON_INTERPRET=1``) and the PyTorch reference
attention run on the carried pages. The Hopper backend's use of them runs on the device (``test_serving_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving import chunked_tile_pages
from fpv2.serving.backends import HopperBackend, ReferenceBackend
from fpv2.serving.chunked import ChunkedPrefillPipeline
from fpv2.serving.fallback_backend import FallbackBackend
from fpv2.serving.tile_repack_policy import REPACK_ENV, should_carry_tile_pages

SPARSE = SelectionConfig(alpha=0.1, sink_tokens=128, window_tokens=128, min_sparse_kv_len=0)


class CarryingBackend(ReferenceBackend):
    """The reference backend run on the carried tile pages; checks every row it is handed against the cache."""

    def __init__(self, carries: bool = True, name: str = "carrying") -> None:
        self.name = name
        self.carries = carries
        self.asked_bytes: list[int] = []
        self.received: list[object] = []
        self.kv_lens: list[int] = []

    def serves(self, q, k_cache, batch, index):
        return None

    def carries_tile_pages(self, q, k_cache, batch, copy_bytes):
        self.asked_bytes.append(copy_bytes)
        return self.carries

    def run(self, q, k_cache, v_cache, batch, index, plan, *, tile_copies=None, **kwargs):
        self.received.append(tile_copies)
        if tile_copies is not None:
            kv_len = batch.host.seqlens_k[0]
            self.kv_lens.append(kv_len)
            pos = torch.arange(kv_len)
            pages = batch.page_table[0].long()[pos // batch.page_size]
            for tiles, cache in ((tile_copies.k_cache, k_cache), (tile_copies.v_cache, v_cache)):
                rows = tiles.reshape(-1, *tiles.shape[2:])
                assert torch.equal(rows[:kv_len], cache[pages, pos % batch.page_size])
                end = -(-kv_len // 128) * 128
                assert bool((rows[kv_len:end] == 0).all())  # the last page's rows past the KV: zeros
            k_cache, v_cache, batch = tile_copies.k_cache, tile_copies.v_cache, tile_copies.batch
        return super().run(q, k_cache, v_cache, batch, index, plan, **kwargs)


@pytest.fixture
def triton_copy():
    """The tile copy on the CPU needs the Triton interpreter."""
    pytest.importorskip("triton")
    from fpv2.index.triton import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 to run the tile copy on the CPU")


@pytest.fixture
def copied_tokens(monkeypatch):
    """KV tokens each tile copy launch was asked to copy, in order."""
    from fpv2.kernel.triton import tile_repack

    seen: list[int] = []
    copy = tile_repack.repack_into_tile_pages

    def spy(k_cache, v_cache, batch, k_tiles, v_tiles, **kwargs):
        seen.append(sum(batch.host.seqlens_k))
        return copy(k_cache, v_cache, batch, k_tiles, v_tiles, **kwargs)

    monkeypatch.setattr(tile_repack, "repack_into_tile_pages", spy)
    return seen


def _prompt(page_size: int, prefix: int = 0):
    return planted_workload(
        [700], [700 + prefix], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size, dtype=torch.float32
    )


@pytest.mark.parametrize(("page_size", "chunk", "prefix"), [(1, 200, 0), (16, 256, 0), (48, 200, 0), (1, 300, 130)])
def test_chunks_run_on_carried_pages_and_give_the_same_output(triton_copy, copied_tokens, page_size, chunk, prefix):
    w = _prompt(page_size, prefix)
    backend = CarryingBackend()
    got = ChunkedPrefillPipeline(SPARSE, backend=backend).run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=chunk)
    want = ChunkedPrefillPipeline(SPARSE, backend="reference").run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=chunk)
    chunks = -(-700 // chunk)
    assert len(backend.received) == chunks and all(c is not None for c in backend.received)
    storages = {c.k_cache.data_ptr() for c in backend.received}
    assert len(storages) == 1  # one copy of the whole prompt, kept by the request's state
    assert backend.asked_bytes == [2 * -(-(700 + prefix) // 128) * 128 * 2 * 64 * 4]  # asked once, at the start
    assert backend.kv_lens == [min(prefix + (i + 1) * chunk, 700 + prefix) for i in range(chunks)]
    assert torch.equal(got.out, want.out)
    # Each chunk copies from the page holding its first token (from 0 where that page starts inside a cache
    # page): about the prompt once, not the prefix again at every chunk.
    assert len(copied_tokens) == chunks and copied_tokens[0] == prefix + chunk
    if page_size != 48:
        assert sum(copied_tokens) <= 700 + prefix + chunks * 128


def test_a_retried_chunk_copies_its_pages_again(triton_copy, copied_tokens):
    w = _prompt(1)
    backend = CarryingBackend()
    pipe = ChunkedPrefillPipeline(SPARSE, backend=backend)
    state = pipe.new_state(prompt_len=700)
    whole = pipe.run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=300)
    from fpv2.serving.chunked_pooling import batch_from_host

    table = w.batch.page_table
    for begin, end in ((0, 300), (300, 600), (300, 600), (600, 700)):  # the second chunk is run twice
        batch = batch_from_host([end - begin], [end], table, page_size=1, num_pages=w.batch.num_pages)
        out = pipe.run_chunk(w.q[begin:end], w.k_cache, w.v_cache, batch, [state]).result.out
        torch.testing.assert_close(out, whole.out[begin:end], rtol=0, atol=0)
    assert copied_tokens[-4:] == [300, 600 - 256, 600 - 256, 700 - 512]


def test_no_pages_are_carried_when_the_backend_declines_or_cannot_say(triton_copy):
    w = _prompt(1)
    declining = CarryingBackend(carries=False)
    ChunkedPrefillPipeline(SPARSE, backend=declining).run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=300)
    assert declining.received == [None, None, None] and len(declining.asked_bytes) == 3  # asked again each chunk
    silent = CarryingBackend()
    silent.carries_tile_pages = None  # a backend without the method
    ChunkedPrefillPipeline(SPARSE, backend=silent).run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=300)
    assert silent.received == [None, None, None]


def test_no_pages_are_carried_for_two_requests_or_an_unknown_prompt_length(triton_copy):
    w = planted_workload(
        [300, 200], [300, 400], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=1, dtype=torch.float32
    )
    backend = CarryingBackend()
    got = ChunkedPrefillPipeline(SPARSE, backend=backend).run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=200)
    # The first chunk holds both requests: no pages. The second only the first request: its pages from the start.
    assert backend.received[0] is None and backend.received[1] is not None and backend.kv_lens == [300]
    want = ChunkedPrefillPipeline(SPARSE, backend="reference").run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=200)
    assert torch.equal(got.out, want.out)
    one = _prompt(1)
    pipe = ChunkedPrefillPipeline(SPARSE, backend=CarryingBackend())
    state = pipe.new_state()  # no prompt_len: the whole prompt's pages cannot be sized
    pipe.run_chunk(one.q, one.k_cache, one.v_cache, one.batch, [state])
    assert pipe.backend.received == [None] and state.tile_k is None


def test_the_pages_are_released_after_the_last_chunk_and_by_reset(triton_copy):
    from fpv2.serving.chunked_pooling import batch_from_host

    w = _prompt(1)
    pipe = ChunkedPrefillPipeline(SPARSE, backend=CarryingBackend())
    state = pipe.new_state(prompt_len=700)
    first = batch_from_host([400], [400], w.batch.page_table, page_size=1, num_pages=w.batch.num_pages)
    pipe.run_chunk(w.q[:400], w.k_cache, w.v_cache, first, [state])
    assert state.tile_k is not None and state.tile_tokens == 400 and state.tile_k.shape[0] == 6
    last = batch_from_host([300], [700], w.batch.page_table, page_size=1, num_pages=w.batch.num_pages)
    pipe.run_chunk(w.q[400:], w.k_cache, w.v_cache, last, [state])
    assert pipe.backend.kv_lens == [400, 700]  # the last chunk ran on the pages, then they were dropped
    assert state.tile_k is None and state.tile_v is None and state.tile_table is None and state.tile_tokens == 0
    pipe.run_chunk(w.q[:400], w.k_cache, w.v_cache, first, [state])  # a new prefill of the same request
    assert state.tile_k is not None
    state.reset()
    assert state.tile_k is None and state.tile_v is None and state.tile_table is None and state.tile_tokens == 0


@pytest.fixture
def triton_pooling(triton_copy, monkeypatch):
    """The chunked pipeline's pooling on the fused Triton kernel (the CUDA path), under the interpreter."""
    monkeypatch.setattr("fpv2.serving.chunked.use_triton_index", lambda q: True)


@pytest.mark.parametrize(("page_size", "chunk", "prefix"), [(1, 200, 0), (16, 256, 0), (1, 300, 130)])
def test_the_pooling_launch_fills_the_carried_pages(triton_pooling, copied_tokens, page_size, chunk, prefix):
    w = _prompt(page_size, prefix)
    backend = CarryingBackend()  # checks every page it is handed against the cache, zeros past the KV
    got = ChunkedPrefillPipeline(SPARSE, backend=backend).run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=chunk)
    # The same pooling kernel without pages: same statistics, so the same index and output.
    plain = CarryingBackend(carries=False)
    want = ChunkedPrefillPipeline(SPARSE, backend=plain).run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=chunk)
    chunks = -(-700 // chunk)
    assert backend.kv_lens == [min(prefix + (i + 1) * chunk, 700 + prefix) for i in range(chunks)]
    assert torch.equal(got.out, want.out)
    assert copied_tokens == []  # no copy launch of its own: the pooling wrote every page


def test_the_fused_copy_can_be_turned_off(triton_pooling, copied_tokens, monkeypatch):
    w = _prompt(1)
    monkeypatch.setenv(chunked_tile_pages.FUSED_COPY_ENV, "0")
    backend = CarryingBackend()
    got = ChunkedPrefillPipeline(SPARSE, backend=backend).run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=300)
    assert backend.kv_lens == [300, 600, 700] and copied_tokens == [300, 600 - 256, 700 - 512]
    monkeypatch.setenv(chunked_tile_pages.FUSED_COPY_ENV, "1")
    fused = ChunkedPrefillPipeline(SPARSE, backend=CarryingBackend()).run(
        w.q, w.k_cache, w.v_cache, w.batch, chunk_size=300
    )
    assert torch.equal(got.out, fused.out) and len(copied_tokens) == 3
    monkeypatch.setenv(chunked_tile_pages.FUSED_COPY_ENV, "yes")
    pipe = ChunkedPrefillPipeline(SPARSE, backend=CarryingBackend())
    with pytest.raises(ValueError, match="FPV2_CHUNKED_FUSED_TILE_COPY must be 0 or 1; got 'yes'"):
        pipe.run(w.q, w.k_cache, w.v_cache, w.batch, chunk_size=300)


def test_the_pooling_copy_leaves_the_state_table_and_other_pages_alone(triton_copy):
    from fpv2.serving.chunked_pooling import batch_from_host, pool_chunk

    w = _prompt(1)
    state = ChunkedPrefillPipeline(SPARSE).new_state(prompt_len=700)
    assert chunked_tile_pages.reserve_tile_pages(CarryingBackend(), w.q, w.k_cache, w.batch, [state])
    state.tile_k.fill_(7.0)
    state.tile_v.fill_(7.0)
    table = w.batch.page_table
    first = batch_from_host([300], [300], table, page_size=1, num_pages=w.batch.num_pages)
    stats = pool_chunk([state], w.k_cache, w.v_cache, first, block_size=128, use_triton=True, copy_tile_pages=True)
    assert stats.tile_pages_copied and state.tile_tokens == 300
    assert torch.equal(state.tile_table, torch.arange(6, dtype=torch.int32)[None, :])  # the kernel's table is scratch
    rows_k = state.tile_k.reshape(-1, *state.tile_k.shape[2:])
    assert torch.equal(rows_k[:300], w.k_cache[table[0, :300].long(), 0])
    assert bool((rows_k[300:384] == 0).all()) and bool((rows_k[384:] == 7).all())  # pages past the chunk: untouched
    # The next chunk starts inside page 2 (token 300): the pooling re-pools block 2 and rewrites pages 2.. only.
    state.tile_k[:2].fill_(5.0)
    second = batch_from_host([300], [600], table, page_size=1, num_pages=w.batch.num_pages)
    stats = pool_chunk([state], w.k_cache, w.v_cache, second, block_size=128, use_triton=True, copy_tile_pages=True)
    assert stats.tile_pages_copied and state.tile_tokens == 600
    assert bool((rows_k[:256] == 5).all())
    assert torch.equal(rows_k[256:600], w.k_cache[table[0, 256:600].long(), 0])
    rows_v = state.tile_v.reshape(-1, *state.tile_v.shape[2:])
    assert torch.equal(rows_v[256:600], w.v_cache[table[0, 256:600].long(), 0])


def test_the_pooling_copies_fp8_pages_as_raw_bytes_and_pools_them_descaled(triton_copy):
    from fpv2.kernel.reference import pool_blocks
    from fpv2.serving.chunked_pooling import batch_from_host, pool_chunk

    w = _prompt(1)
    k8, v8 = w.k_cache.to(torch.float8_e4m3fn), w.v_cache.to(torch.float8_e4m3fn)
    k_descale, v_descale = torch.tensor([[0.5, 2.0]]), torch.tensor([[0.25, 4.0]])
    state = ChunkedPrefillPipeline(SPARSE).new_state(prompt_len=700)
    assert chunked_tile_pages.reserve_tile_pages(CarryingBackend(), w.q, k8, w.batch, [state])
    assert state.tile_k.dtype == torch.float8_e4m3fn
    batch = batch_from_host([300], [300], w.batch.page_table, page_size=1, num_pages=w.batch.num_pages)
    descales = {"k_descale": k_descale, "v_descale": v_descale}
    stats = pool_chunk([state], k8, v8, batch, block_size=128, use_triton=True, copy_tile_pages=True, **descales)
    assert stats.tile_pages_copied
    tokens = w.batch.page_table[0, :300].long()
    for tiles, cache in ((state.tile_k, k8), (state.tile_v, v8)):
        rows = tiles.reshape(-1, *tiles.shape[2:])[:300]
        assert torch.equal(rows.view(torch.uint8), cache[tokens, 0].view(torch.uint8))  # the e4m3 bytes, unscaled
    want = pool_blocks(k8, v8, batch, block_size=128, **descales)
    torch.testing.assert_close(stats.statistics.pooled_k, want.pooled_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(stats.statistics.pooled_v, want.pooled_v, rtol=0, atol=1e-5)


def test_the_pooling_leaves_the_copy_to_its_own_launch_where_it_cannot_make_it(triton_copy, copied_tokens):
    from fpv2.serving.chunked_pooling import batch_from_host, pool_chunk

    def reserved(page_size: int):
        w = _prompt(page_size)
        state = ChunkedPrefillPipeline(SPARSE).new_state(prompt_len=700)
        chunked_tile_pages.reserve_tile_pages(CarryingBackend(), w.q, w.k_cache, w.batch, [state])
        batch = batch_from_host([300], [300], w.batch.page_table, page_size=page_size, num_pages=w.batch.num_pages)
        return w, state, batch

    w, state, batch = reserved(1)
    kw = {"block_size": 128, "copy_tile_pages": True}
    assert not pool_chunk([state], w.k_cache, w.v_cache, batch, use_triton=False, **kw).tile_pages_copied  # reference
    w, state, batch = reserved(1)
    assert not pool_chunk([state], w.k_cache, None, batch, use_triton=True, **kw).tile_pages_copied  # keys only
    w, state, batch = reserved(1)
    assert not pool_chunk([state], w.k_cache, w.v_cache, batch, use_triton=True, block_size=128).tile_pages_copied
    assert state.tile_tokens == 0
    # Its pages behind the pooled blocks (a state pooled without them): the copy is its own launch.
    w, state, batch = reserved(1)
    pool_chunk([state], w.k_cache, w.v_cache, batch, use_triton=True, block_size=128)
    later = batch_from_host([300], [600], w.batch.page_table, page_size=1, num_pages=w.batch.num_pages)
    assert not pool_chunk([state], w.k_cache, w.v_cache, later, use_triton=True, **kw).tile_pages_copied
    copies = chunked_tile_pages.carried_tile_copies(CarryingBackend(), w.q, w.k_cache, w.v_cache, later, [state])
    assert copies is not None and copied_tokens == [600] and state.tile_tokens == 600
    with pytest.raises(RuntimeError, match="fill the tile pages up to 700 tokens; they hold 600"):
        end = batch_from_host([100], [700], w.batch.page_table, page_size=1, num_pages=w.batch.num_pages)
        chunked_tile_pages.carried_tile_copies(CarryingBackend(), w.q, w.k_cache, w.v_cache, end, [state], copied=True)


def test_the_carry_rule(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(REPACK_ENV, raising=False)
    assert not should_carry_tile_pages(128, 128, 1 << 20, cpu)  # tile pages are read as they are
    assert not should_carry_tile_pages(256, 128, 1 << 20, cpu)
    assert should_carry_tile_pages(1, 128, 1 << 20, cpu) == _has_triton()  # off CUDA no memory limit applies
    monkeypatch.setenv(REPACK_ENV, "0")
    assert not should_carry_tile_pages(1, 128, 1 << 20, cpu)
    monkeypatch.setenv(REPACK_ENV, "sometimes")
    with pytest.raises(ValueError, match="FPV2_HOPPER_REPACK='sometimes'"):
        should_carry_tile_pages(1, 128, 1 << 20, cpu)


def test_the_carry_rule_applies_the_memory_check(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv(REPACK_ENV, raising=False)
    asked = []
    monkeypatch.setattr(
        "fpv2.serving.tile_repack_policy.copies_fit", lambda needed, device: asked.append(needed) or needed < 100
    )
    assert should_carry_tile_pages(16, 128, 99, torch.device("cpu"))
    assert not should_carry_tile_pages(16, 128, 100, torch.device("cpu"))
    assert asked == [99, 100]
    monkeypatch.setenv(REPACK_ENV, "1")  # forced: no memory check
    assert should_carry_tile_pages(16, 128, 100, torch.device("cpu")) and asked == [99, 100]


def test_the_hopper_backend_carries_only_calls_it_serves():
    w = _prompt(1)
    # CPU inputs: the kernel does not serve them, so no copy is carried for it.
    assert HopperBackend().carries_tile_pages(w.q, w.k_cache, w.batch, 1 << 20) is False
    primary, fallback = CarryingBackend(name="primary"), CarryingBackend(name="fallback")
    assert FallbackBackend(primary, fallback).carries_tile_pages(w.q, w.k_cache, w.batch, 7) is True
    assert primary.asked_bytes == [7] and fallback.asked_bytes == []
    assert FallbackBackend(ReferenceBackend(), fallback).carries_tile_pages(w.q, w.k_cache, w.batch, 7) is False


def test_the_module_names_its_tile():
    pytest.importorskip("triton")
    from fpv2.kernel.triton.tile_repack import TILE_TOKENS

    assert chunked_tile_pages.TILE_TOKENS == TILE_TOKENS == HopperBackend.kv_tile


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
