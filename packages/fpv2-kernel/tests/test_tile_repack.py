"""Tile repacking (``fpv2.kernel.triton.tile_repack``): small pages copied into 128-token pages.

The copy is checked against the per-request ground truth of :func:`conftest.make_case` (keys and values
before they were scattered through a random page permutation, spare slots NaN): every token lands at
row ``t % 128`` of its request's tile page ``t // 128``, requests take consecutive tile pages, rows past
a request are zero, and attention over the repacked cache equals attention over the original one. On
CPU machines the kernel runs under the Triton interpreter; with a CUDA GPU it runs there too.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from conftest import make_case

from fpv2.kernel.reference import dense_attention

try:
    from fpv2.kernel.triton.launch import is_interpreted
    from fpv2.kernel.triton.tile_repack import (
        TILE_TOKENS,
        repack_into_tile_pages,
        repack_to_tile_pages,
        tile_batch,
        tile_pages_per_request,
        tile_repack_bytes,
    )
except ImportError:  # pragma: no cover - triton is an extra
    repack_to_tile_pages = None
DEVICE = (
    None
    if repack_to_tile_pages is None
    else "cpu"
    if is_interpreted()
    else "cuda"
    if torch.cuda.is_available()
    else None
)
needs_kernel = pytest.mark.skipif(
    DEVICE is None, reason="needs Triton and a CUDA GPU, or TRITON_INTERPRET=1 before triton is imported"
)

#: (seqlens_q, seqlens_k, page_size, Hkv, d): one token, exact tiles, ragged tails, a prefix, an empty
#: request between others, a page size that is not a power of two, and a row (Hkv * d) that is not either.
CASES = [
    ([1], [1], 1, 2, 64),
    ([300], [300], 1, 2, 64),
    ([128, 5, 200], [256, 5, 331], 16, 2, 64),
    ([40, 0, 129], [40, 0, 129], 24, 3, 64),
    ([70], [500], 64, 1, 128),
]


@needs_kernel
@pytest.mark.parametrize(("seqlens_q", "seqlens_k", "page_size", "num_kv_heads", "head_dim"), CASES)
@pytest.mark.parametrize(("dtype", "tokens"), [(torch.float32, 16), (torch.float16, 64)])
def test_tokens_land_in_their_tile_rows_and_tails_are_zero(
    seqlens_q: list[int],
    seqlens_k: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    tokens: int,
) -> None:
    case = make_case(
        seqlens_q,
        seqlens_k,
        num_q_heads=2 * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        device=DEVICE,
        seed=sum(seqlens_k) + page_size,
    )
    packed = repack_to_tile_pages(case.k_cache, case.v_cache, case.batch, tokens_per_program=tokens)
    pages = [-(-n // TILE_TOKENS) for n in seqlens_k]
    assert tile_pages_per_request(case.batch) == pages
    total = max(sum(pages), 1)
    assert packed.k_cache.shape == (total, TILE_TOKENS, num_kv_heads, head_dim) and packed.k_cache.is_contiguous()
    assert packed.v_cache.shape == packed.k_cache.shape and packed.k_cache.dtype == dtype
    assert tile_repack_bytes(case.k_cache, case.batch) == 2 * sum(pages) * TILE_TOKENS * num_kv_heads * head_dim * (
        case.k_cache.element_size()
    )
    batch = packed.batch
    assert batch.page_size == TILE_TOKENS and batch.num_pages == total
    assert batch.cu_seqlens_q is case.batch.cu_seqlens_q and batch.seqlens_k is case.batch.seqlens_k
    batch.validate_values()  # every used page id within the repacked cache
    k_rows = packed.k_cache.reshape(-1, num_kv_heads, head_dim).float().cpu()
    v_rows = packed.v_cache.reshape(-1, num_kv_heads, head_dim).float().cpu()
    table = batch.page_table.cpu()
    start = 0
    for b, kv_len in enumerate(seqlens_k):
        assert table[b, : pages[b]].tolist() == list(range(start, start + pages[b]))
        rows = slice(start * TILE_TOKENS, start * TILE_TOKENS + kv_len)
        torch.testing.assert_close(k_rows[rows], case.keys[b].float().cpu(), rtol=0, atol=0)
        torch.testing.assert_close(v_rows[rows], case.values[b].float().cpu(), rtol=0, atol=0)
        tail = slice(start * TILE_TOKENS + kv_len, (start + pages[b]) * TILE_TOKENS)
        assert bool((k_rows[tail] == 0).all()) and bool((v_rows[tail] == 0).all())
        start += pages[b]


@needs_kernel
def test_attention_over_the_repacked_cache_equals_the_original() -> None:
    case = make_case([90, 250], [90, 400], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=1, device=DEVICE)
    packed = repack_to_tile_pages(case.k_cache, case.v_cache, case.batch)
    want = dense_attention(case.q, case.k_cache, case.v_cache, case.batch)
    got = dense_attention(case.q, packed.k_cache, packed.v_cache, packed.batch)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _strided_views(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V as views of one buffer in an engine's physical layout (values equal, strides not)."""
    if layout == "kv-pages":  # (num_pages, 2, page_size, Hkv, d): K and V pages interleaved, page stride 2x
        both = torch.stack([k_cache, v_cache], dim=1).contiguous()
        return both[:, 0], both[:, 1]
    # vLLM 0.33: one (num_pages, Hkv, page_size, 2 d) buffer per layer, token-major (NHD) or head-major (HND)
    # inside a page, read as transpose(1, 2).split(d, -1): head stride 2 d (NHD) or page_size * 2 d (HND).
    both = torch.cat([k_cache, v_cache], dim=-1)
    if layout == "vllm-hnd":
        both = both.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        both = both.contiguous()
    head_dim = k_cache.shape[-1]
    return both[..., :head_dim], both[..., head_dim:]


@needs_kernel
@pytest.mark.parametrize("layout", ["kv-pages", "vllm-nhd", "vllm-hnd"])
def test_strided_views_of_one_buffer_are_read_through_their_strides(layout: str) -> None:
    case = make_case([30, 200], [30, 333], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, device=DEVICE)
    k_view, v_view = _strided_views(case.k_cache, case.v_cache, layout)
    torch.testing.assert_close(k_view, case.k_cache, rtol=0, atol=0, equal_nan=True)  # spare slots are NaN
    assert not k_view.is_contiguous()
    assert (k_view.stride(2) == 64) == (layout == "kv-pages")  # the vLLM views' heads are not dense rows
    packed = repack_to_tile_pages(k_view, v_view, case.batch)
    want = repack_to_tile_pages(case.k_cache, case.v_cache, case.batch)
    torch.testing.assert_close(packed.k_cache, want.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(packed.v_cache, want.v_cache, rtol=0, atol=0)
    k_rows = packed.k_cache.reshape(-1, 2, 64).float().cpu()
    torch.testing.assert_close(k_rows[128 * 1 : 128 * 1 + 333], case.keys[1].float().cpu(), rtol=0, atol=0)


@needs_kernel
def test_the_tile_batch_is_made_once_per_batch() -> None:
    # Every layer of a forward pass copies its own K/V with one batch: the tile batch (and the C-ABI struct built
    # from it) is made once; each copy still writes the page table and its own K/V.
    case = make_case([40, 300], [40, 300], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, device=DEVICE)
    first = repack_to_tile_pages(case.k_cache, case.v_cache, case.batch)
    assert tile_batch(case.batch) is first.batch
    k2, v2 = case.k_cache * 2 + 1, case.v_cache - 3  # the next layer's K/V, in the same pages
    second = repack_to_tile_pages(k2, v2, case.batch)
    assert second.batch is first.batch and second.k_cache.data_ptr() != first.k_cache.data_ptr()
    assert not torch.equal(second.k_cache[1], first.k_cache[1])  # the second layer's keys, not the first's
    table = second.batch.page_table.tolist()
    assert table[0][:1] == [0] and table[1] == [1, 2, 3]  # entries past a request's pages are never read
    want = repack_to_tile_pages(k2, v2, dataclasses.replace(case.batch))  # a fresh batch object: a new tile batch
    assert want.batch is not first.batch
    torch.testing.assert_close(second.k_cache, want.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(second.v_cache, want.v_cache, rtol=0, atol=0)


@needs_kernel
def test_bad_caches_are_refused_with_their_name() -> None:
    case = make_case([20], [20], page_size=4, device=DEVICE)
    with pytest.raises(TypeError, match="v_cache must match k_cache"):
        repack_to_tile_pages(case.k_cache, case.v_cache.half(), case.batch)
    with pytest.raises(ValueError, match=r"k_cache: the copy reads each head's d values as one run"):
        repack_to_tile_pages(case.k_cache.transpose(2, 3), case.v_cache, case.batch)
    with pytest.raises(ValueError, match=r"v_cache must be \(num_pages, page_size, Hkv, d\)"):
        repack_to_tile_pages(case.k_cache, case.v_cache[0], case.batch)
    for tokens in (0, 24, 256):
        with pytest.raises(ValueError, match=f"tokens_per_program must be a power of two dividing 128; got {tokens}"):
            repack_to_tile_pages(case.k_cache, case.v_cache, case.batch, tokens_per_program=tokens)
    halves = case.k_cache.reshape(-1, 2, *case.k_cache.shape[2:])  # the same tokens in pages of 2
    with pytest.raises(ValueError, match="pages of 2 tokens, the batch says page_size=4"):
        repack_to_tile_pages(halves, halves, case.batch)


@needs_kernel
def test_a_copy_into_caller_pages_writes_the_pages_it_is_given_and_no_others() -> None:
    case = make_case([70, 200], [70, 331], num_kv_heads=2, head_dim=64, page_size=16, device=DEVICE)
    want = repack_to_tile_pages(case.k_cache, case.v_cache, case.batch)
    pages = want.k_cache.shape[0]
    shape = (pages + 3, *want.k_cache.shape[1:])
    k_tiles = torch.full(shape, float("nan"), dtype=case.k_cache.dtype, device=DEVICE)
    v_tiles = torch.full(shape, float("nan"), dtype=case.k_cache.dtype, device=DEVICE)
    got = repack_into_tile_pages(case.k_cache, case.v_cache, case.batch, k_tiles[2 : 2 + pages], v_tiles[2:])
    assert got.k_cache.data_ptr() == k_tiles[2].data_ptr() and got.batch is want.batch  # the batch's tile batch
    torch.testing.assert_close(k_tiles[2 : 2 + pages], want.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(v_tiles[2 : 2 + pages], want.v_cache, rtol=0, atol=0)
    for tiles in (k_tiles, v_tiles):  # pages before and after the views are not touched
        assert bool(tiles[:2].isnan().all()) and bool(tiles[2 + pages :].isnan().all())


@needs_kernel
def test_caller_pages_of_the_wrong_kind_are_refused_with_their_name() -> None:
    case = make_case([20], [300], num_kv_heads=2, head_dim=64, page_size=4, device=DEVICE)
    k_tiles = torch.empty((3, TILE_TOKENS, 2, 64), dtype=case.k_cache.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="k_tiles holds 2 tile pages; the batch needs 3"):
        repack_into_tile_pages(case.k_cache, case.v_cache, case.batch, k_tiles[:2], k_tiles)
    with pytest.raises(TypeError, match="v_tiles must have the caches' dtype"):
        repack_into_tile_pages(case.k_cache, case.v_cache, case.batch, k_tiles, k_tiles.double())
    with pytest.raises(ValueError, match=r"v_tiles must be \(n, 128, 2, 64\)"):
        repack_into_tile_pages(case.k_cache, case.v_cache, case.batch, k_tiles, k_tiles[:, :64])
    strided = torch.empty((3, TILE_TOKENS, 64, 2), dtype=case.k_cache.dtype, device=DEVICE).transpose(2, 3)
    with pytest.raises(ValueError, match="k_tiles must be contiguous"):
        repack_into_tile_pages(case.k_cache, case.v_cache, case.batch, strided, k_tiles)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the direct relaunch runs on a GPU (the interpreter launches normally)")
@pytest.mark.skipif(os.environ.get("FPV2_TRITON_RELAUNCH") == "0", reason="relaunch disabled by the environment")
def test_later_copies_relaunch_the_compiled_kernel_directly() -> None:
    from fpv2.kernel.triton import tile_repack

    case = make_case([90, 250], [90, 400], num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=1, device=DEVICE)
    first = repack_to_tile_pages(case.k_cache, case.v_cache, case.batch)
    before = tile_repack._REPACK.direct
    again = repack_to_tile_pages(case.k_cache, case.v_cache, case.batch)
    assert tile_repack._REPACK.direct == before + 1
    torch.testing.assert_close(again.k_cache, first.k_cache, rtol=0, atol=0)
    torch.testing.assert_close(again.v_cache, first.v_cache, rtol=0, atol=0)
