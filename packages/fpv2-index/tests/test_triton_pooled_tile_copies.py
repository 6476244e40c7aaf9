"""The pooling kernel's copy of K/V into tile pages (``pool_blocks_triton(..., tile_copies=...)``).

- the tile pages and their page table are those of ``repack_to_tile_pages``, bit for bit, for every cache
  dtype, page size, head count (one and several head groups per program, padded head dims) and varlen batch,
  on buffers poisoned beforehand (every row is written, zeros past a request's length);
- the pooled outputs do not change when the copy is asked for;
- bad ``tile_copies`` are refused with the argument named.

CPU runs use the Triton interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

# The Triton index tests' shared skip rules and device (pytest applies the imported ``pytestmark``).
from test_triton_index import DEVICE, pytestmark  # noqa: F401

from fpv2.index.triton import pool_blocks_triton
from fpv2.kernel.testing import planted_workload
from fpv2.kernel.triton.tile_repack import allocate_tile_pages, repack_to_tile_pages


def _workload(dtype: torch.dtype, page_size: int, num_kv_heads: int, head_dim: int):
    return planted_workload(
        [96, 40, 1],
        [300, 128, 129],
        num_q_heads=num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        block_size=128,
        dtype=dtype,
        device=DEVICE,
        seed=7,
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _poisoned(w):
    copies = allocate_tile_pages(w.k_cache, w.v_cache, w.batch)
    for tiles in (copies.k_cache, copies.v_cache):
        _bits(tiles).fill_(0x7F)  # NaN-like bytes in every dtype: a row the kernel skips stays visible
    copies.batch.page_table.fill_(-1)
    return copies


# Each dtype, page size and head shape at least once (the interpreter is slow): one and several head groups per
# program, a padded head dim.
CASES = [
    (torch.bfloat16, 1, 2, 64),
    (torch.bfloat16, 16, 8, 256),
    (torch.float16, 16, 3, 48),
    (torch.float32, 1, 3, 48),
]


@pytest.mark.parametrize(
    ("dtype", "page_size", "num_kv_heads", "head_dim"),
    CASES,
    ids=[f"{str(c[0]).split('.')[-1]}-page{c[1]}-{c[2]}x{c[3]}" for c in CASES],
)
def test_tile_pages_equal_the_repack(dtype, page_size, num_kv_heads, head_dim) -> None:
    w = _workload(dtype, page_size, num_kv_heads, head_dim)
    copies = _poisoned(w)
    stats = pool_blocks_triton(w.k_cache, w.v_cache, w.batch, tile_copies=copies)
    repacked = repack_to_tile_pages(w.k_cache, w.v_cache, w.batch)
    assert copies.batch is repacked.batch  # the one tile batch kept on the input batch
    assert torch.equal(_bits(copies.k_cache), _bits(repacked.k_cache))
    assert torch.equal(_bits(copies.v_cache), _bits(repacked.v_cache))
    pages = [-(-n // 128) for n in w.batch.host.seqlens_k]
    table = copies.batch.page_table.cpu()
    first = 0
    for b, count in enumerate(pages):
        assert table[b, :count].tolist() == list(range(first, first + count))
        first += count
    plain = pool_blocks_triton(w.k_cache, w.v_cache, w.batch)
    for name in ("pooled_k", "pooled_v", "block_lengths", "block_offsets"):
        assert torch.equal(getattr(plain, name), getattr(stats, name)), name
    assert torch.equal(plain.prepared_keys.keys, stats.prepared_keys.keys)


def test_rows_past_each_request_are_zero() -> None:
    w = _workload(torch.bfloat16, 1, 2, 64)
    copies = _poisoned(w)
    pool_blocks_triton(w.k_cache, w.v_cache, w.batch, tile_copies=copies)
    # Request 0 has 300 tokens: its third tile page holds 44, request 2 has 129: its second page holds 1.
    assert not copies.k_cache[2, 44:].any() and not copies.v_cache[2, 44:].any()
    assert copies.k_cache[2, :44].abs().sum() > 0
    assert not copies.k_cache[5, 1:].any() and copies.k_cache[5, 0].abs().sum() > 0


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda w, c: {"tile_copies": "pages"}, TypeError, "tile_copies must be a TileRepacked"),
        (lambda w, c: {"tile_copies": c, "block_size": 64}, ValueError, "block_size=128"),
        (lambda w, c: {"tile_copies": c, "v_cache": None}, ValueError, "needs v_cache"),
        (
            lambda w, c: {"tile_copies": type(c)(c.k_cache[:1], c.v_cache, c.batch)},
            ValueError,
            "tile_copies.k_cache must be",
        ),
        (
            lambda w, c: {"tile_copies": type(c)(c.k_cache, c.v_cache.float(), c.batch)},
            ValueError,
            "tile_copies.v_cache must be",
        ),
    ],
)
def test_bad_tile_copies_are_refused(change, error, match) -> None:
    w = _workload(torch.bfloat16, 16, 2, 64)
    copies = allocate_tile_pages(w.k_cache, w.v_cache, w.batch)
    kwargs = {"v_cache": w.v_cache, **change(w, copies)}
    v_cache = kwargs.pop("v_cache")
    with pytest.raises(error, match=match):
        pool_blocks_triton(w.k_cache, v_cache, w.batch, **kwargs)
