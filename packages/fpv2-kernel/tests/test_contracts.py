"""Every bad input named by the contracts raises the documented error type and text."""

from __future__ import annotations

import pytest
import torch

from fpv2.kernel import BlockIndex, BlockStatistics, CorrectionPlan, PagedPrefillBatch, validate_prefill_inputs
from fpv2.kernel.contracts import expected_tile_offsets, tile_span


def make_batch(seqlens_q=(5, 0, 7), seqlens_k=(300, 10, 7), page_size=16):
    return PagedPrefillBatch.contiguous(list(seqlens_q), list(seqlens_k), page_size=page_size)


def make_inputs(batch, hq=8, hkv=2, d=64, dtype=torch.float16):
    k = torch.randn(batch.num_pages, batch.page_size, hkv, d).to(dtype)
    q = torch.randn(batch.total_q, hq, d).to(dtype)
    return q, k, k.clone()


def raw_batch(cu, sk, table, page_size=4, num_pages=8):
    return PagedPrefillBatch(
        torch.tensor(cu, dtype=torch.int32),
        torch.tensor(sk, dtype=torch.int32),
        torch.tensor(table, dtype=torch.int32),
        page_size,
        num_pages,
    )


# --------------------------------------------------------------------------- batch
def test_valid_batch_derives_prefix_and_lengths():
    batch = make_batch()
    assert batch.prefix.tolist() == [295, 10, 0]
    assert batch.q_lens.tolist() == [5, 0, 7]
    assert batch.total_q == 12 and batch.max_seqlen_k == 300 and batch.num_requests == 3


def test_empty_batch():
    with pytest.raises(ValueError, match="empty batch"):
        raw_batch([0], [], [[0]][:0] or torch.zeros(0, 1, dtype=torch.int32).tolist())
    with pytest.raises(ValueError, match="empty batch"):
        PagedPrefillBatch.contiguous([], [])


def test_wrong_dtype_names_argument():
    with pytest.raises(TypeError, match=r"seqlens_k must have dtype.*int64"):
        PagedPrefillBatch(
            torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4]), torch.zeros(1, 1, dtype=torch.int32), 4, 1
        )


def test_wrong_rank_and_shape():
    with pytest.raises(ValueError, match=r"page_table must have rank 2; got shape \(1,\)"):
        PagedPrefillBatch(
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            4,
            1,
        )
    with pytest.raises(ValueError, match=r"seqlens_k must have shape \(2\)"):
        raw_batch([0, 1, 2], [1], [[0], [1]])


def test_wrong_type():
    with pytest.raises(TypeError, match="cu_seqlens_q must be a torch.Tensor, got list"):
        PagedPrefillBatch([0, 1], torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1, 1)


def test_bad_stride_of_index_arrays():
    sk = torch.tensor([4, 0, 4, 0], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="seqlens_k must be contiguous"):
        PagedPrefillBatch(torch.tensor([0, 1, 2], dtype=torch.int32), sk, torch.zeros(2, 1, dtype=torch.int32), 4, 1)
    table = torch.zeros(2, 2, dtype=torch.int32).t()
    with pytest.raises(ValueError, match="page_table rows must be contiguous"):
        PagedPrefillBatch(
            torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), table, 4, 1
        )


def test_cu_seqlens_must_start_at_zero_and_not_decrease():
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0"):
        raw_batch([1, 3], [4], [[0]])
    with pytest.raises(ValueError, match="non-decreasing; request 1"):
        raw_batch([0, 3, 2], [4, 4], [[0], [1]])


def test_query_longer_than_kv():
    with pytest.raises(ValueError, match=r"query longer than KV: request 1 has 5 queries but seqlens_k\[1\]=3"):
        raw_batch([0, 2, 7], [4, 3], [[0], [1]])


def test_page_table_too_short():
    with pytest.raises(ValueError, match=r"page_table too short: request 0 needs 3 pages for seqlens_k=9"):
        raw_batch([0, 2], [9], [[0, 1]])


def test_page_id_out_of_range():
    with pytest.raises(ValueError, match=r"page id out of range: page_table\[0, 1\]=8, the cache has num_pages=8"):
        raw_batch([0, 2], [6], [[0, 8]])
    with pytest.raises(ValueError, match=r"page_table\[0, 0\]=-1"):
        raw_batch([0, 2], [6], [[-1, 2]])


def test_padding_page_ids_are_ignored():
    batch = raw_batch([0, 2], [4], [[3, -1, 99]])
    assert batch.num_requests == 1


def test_check_values_false_skips_value_checks():
    # The hot path may skip the host-synchronising value checks; metadata checks still run.
    raw = dict(
        cu_seqlens_q=torch.tensor([0, 2, 7], dtype=torch.int32),
        seqlens_k=torch.tensor([4, 3], dtype=torch.int32),
        page_table=torch.zeros(2, 1, dtype=torch.int32),
        page_size=4,
        num_pages=1,
    )
    PagedPrefillBatch(**raw, check_values=False)
    with pytest.raises(ValueError, match="query longer than KV"):
        PagedPrefillBatch(**raw)


def test_scalar_arguments():
    with pytest.raises(ValueError, match="page_size must be positive, got 0"):
        raw_batch([0, 1], [1], [[0]], page_size=0)
    with pytest.raises(TypeError, match="num_pages must be an int, got float"):
        raw_batch([0, 1], [1], [[0]], num_pages=2.0)


def test_zero_length_requests_are_valid():
    batch = PagedPrefillBatch.contiguous([0, 0], [0, 5])
    assert batch.total_q == 0 and batch.prefix.tolist() == [0, 5]


# -------------------------------------------------------------------------- inputs
def test_validate_inputs_ok():
    batch = make_batch()
    shapes = validate_prefill_inputs(*make_inputs(batch), batch)
    assert (shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim, shapes.group) == (8, 2, 64, 4)


def test_gqa_ratio():
    batch = make_batch()
    q, k, v = make_inputs(batch, hq=6, hkv=4)
    with pytest.raises(ValueError, match=r"Hq % Hkv != 0: q has Hq=6 heads \(shape \(12, 6, 64\)"):
        validate_prefill_inputs(q, k, v, batch)


def test_input_dtype_rank_device_and_mixing():
    batch = make_batch()
    q, k, v = make_inputs(batch)
    with pytest.raises(TypeError, match=r"q must have dtype in .*got shape \(12, 8, 64\), dtype torch.int32"):
        validate_prefill_inputs(q.to(torch.int32), k, v, batch)
    with pytest.raises(ValueError, match=r"k_cache must have rank 4; got shape"):
        validate_prefill_inputs(q, k[0], v, batch)
    with pytest.raises(TypeError, match="must share one dtype"):
        validate_prefill_inputs(q, k.float(), v, batch)
    with pytest.raises(ValueError, match="device"):
        validate_prefill_inputs(q.to("meta"), k, v, batch)


def test_input_shapes_against_batch():
    batch = make_batch()
    q, k, v = make_inputs(batch)
    with pytest.raises(ValueError, match=r"q must hold cu_seqlens_q\[-1\]=12 packed queries"):
        validate_prefill_inputs(q[:11], k, v, batch)
    with pytest.raises(ValueError, match=r"k_cache must have shape \(21, 16, \*, 64\)"):
        validate_prefill_inputs(q, k[:20], v, batch)
    with pytest.raises(ValueError, match=r"v_cache must have shape"):
        validate_prefill_inputs(q, k, v[..., :1, :], batch)
    with pytest.raises(ValueError, match=r"head dim must be one of \(64, 128, 256\)"):
        validate_prefill_inputs(q[..., :32], k[..., :32], v[..., :32], batch)


def test_input_inner_stride():
    batch = make_batch()
    q, k, v = make_inputs(batch)
    q_strided = torch.randn(12, 8, 128).to(q.dtype)[..., ::2]
    with pytest.raises(ValueError, match="q must have unit stride in its last dimension"):
        validate_prefill_inputs(q_strided, k, v, batch)


def test_fp8_descales_required_and_checked():
    batch = make_batch()
    q, k, v = (t.to(torch.float8_e4m3fn) for t in make_inputs(batch))
    with pytest.raises(ValueError, match=r"q_descale is required for float8_e4m3fn inputs \(shape \(3, 2\)\)"):
        validate_prefill_inputs(q, k, v, batch)
    ones = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(3, 2\)"):
        validate_prefill_inputs(q, k, v, batch, q_descale=ones, k_descale=ones[:2], v_descale=ones)
    assert validate_prefill_inputs(q, k, v, batch, q_descale=ones, k_descale=ones, v_descale=ones).is_fp8
    q16, k16, v16 = make_inputs(batch)
    with pytest.raises(ValueError, match="only meaningful for float8_e4m3fn"):
        validate_prefill_inputs(q16, k16, v16, batch, q_descale=ones)


# --------------------------------------------------------------------- block index
def full_index(batch, group, hkv, tile_size=128, block_size=128):
    """Every causally visible block, built with plain loops."""
    tiles = expected_tile_offsets(batch, group, tile_size)
    offsets, blocks = [0], []
    for b, (q_len, prefix) in enumerate(zip(batch.host.q_lens, batch.host.prefix)):
        n = int(tiles[b + 1] - tiles[b])
        for _h in range(hkv):
            for t in range(n):
                span = tile_span(t, q_len, prefix, group, tile_size=tile_size, block_size=block_size)
                blocks += list(range(span.num_visible_blocks))
                offsets.append(len(blocks))
    return BlockIndex(
        torch.tensor(offsets, dtype=torch.int32),
        torch.tensor(blocks, dtype=torch.int32),
        tiles,
        hkv,
        group,
        tile_size,
        block_size,
    )


def test_block_index_full_density_and_mask_roundtrip():
    batch = PagedPrefillBatch.contiguous([300, 0, 40], [700, 9, 40])
    index = full_index(batch, group=4, hkv=2)
    index.check_compatible(batch, 4, tile_size=128)
    assert index.density(batch) == 1.0
    mask = index.to_dense_mask()
    again = BlockIndex.from_dense_mask(mask, index.tile_offsets, num_kv_heads=2, group=4)
    assert torch.equal(again.offsets, index.offsets) and torch.equal(again.blocks, index.blocks)
    # request 0, head 1, tile 3: rows 384..511 are positions 96..127, prefix 400 -> blocks 0..4
    assert index.kept_blocks(0, 1, 3) == [0, 1, 2, 3, 4]


def test_block_index_structure_errors():
    tiles = torch.tensor([0, 2], dtype=torch.int32)
    good = dict(tile_offsets=tiles, num_kv_heads=1, group=1)
    with pytest.raises(ValueError, match="must have num_kv_heads \\* tile_offsets\\[-1\\] \\+ 1 = 3 entries"):
        BlockIndex(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), **good)
    with pytest.raises(ValueError, match="strictly ascending within a segment; segment 1"):
        BlockIndex(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 1, 1], dtype=torch.int32), **good)
    with pytest.raises(ValueError, match=r"offsets\[-1\]=2 exceeds the capacity of blocks"):
        BlockIndex(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), **good)
    with pytest.raises(TypeError, match="blocks must have dtype"):
        BlockIndex(torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([0]), **good)
    with pytest.raises(ValueError, match="tile_size must be a power of two, got 96"):
        BlockIndex(
            torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), **good, tile_size=96
        )


def test_block_index_compatibility_is_checked():
    batch = PagedPrefillBatch.contiguous([200], [500])
    index = full_index(batch, group=4, hkv=2)
    with pytest.raises(ValueError, match="tile_size=128 differs from the kernel's query tile 64"):
        index.check_compatible(batch, 4, tile_size=64)
    with pytest.raises(ValueError, match="packed for GQA group 4, the inputs have group 8"):
        index.check_compatible(batch, 8)
    other = PagedPrefillBatch.contiguous([100], [500])
    with pytest.raises(ValueError, match="tile_offsets .* do not match the batch"):
        index.check_compatible(other, 4)
    # a block beyond the causal limit is refused
    bad_blocks = index.blocks.clone()
    bad_blocks[2] = (
        3  # last of segment 0 [0, 1, 2]; segment 0 (tile 0, positions 0..31 at prefix 300) sees blocks 0..2 only
    )
    with pytest.raises(ValueError, match=r"keeps block 3, beyond the causally visible blocks 0..2"):
        BlockIndex(index.offsets, bad_blocks, index.tile_offsets, 2, 4).check_compatible(batch, 4)


# ---------------------------------------------------------------------- statistics
def test_statistics_and_plan_validation():
    stats = BlockStatistics(
        torch.zeros(3, 2, 64),
        torch.zeros(3, 2, 64),
        torch.tensor([128, 128, 5], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
        check_values=True,
    )
    assert stats.num_kv_heads == 2 and stats.head_dim == 64
    with pytest.raises(ValueError, match=r"pooled_v must have shape \(3, 2, 64\)"):
        BlockStatistics(torch.zeros(3, 2, 64), torch.zeros(3, 2, 32), stats.block_lengths, stats.block_offsets)
    with pytest.raises(TypeError, match="pooled_k must have dtype"):
        BlockStatistics(torch.zeros(3, 2, 64).half(), None, stats.block_lengths, stats.block_offsets)
    with pytest.raises(ValueError, match="block_lengths must lie in 1..128"):
        BlockStatistics(
            stats.pooled_k, None, torch.tensor([128, 0, 5], dtype=torch.int32), stats.block_offsets, check_values=True
        )
    with pytest.raises(ValueError, match="needs pooled values"):
        CorrectionPlan(BlockStatistics(stats.pooled_k, None, stats.block_lengths, stats.block_offsets))
    with pytest.raises(ValueError, match="chunk_size must be 64"):
        CorrectionPlan(stats, chunk_size=32)
    with pytest.raises(ValueError, match="come together"):
        CorrectionPlan(stats, todo_offsets=torch.zeros(2, dtype=torch.int32))


def test_assume_host_view_spares_the_read_and_checks_counts():
    from fpv2.kernel.contracts import HostBatchView

    batch = make_batch()
    seeded = batch.assume_host_view(HostBatchView(cu_seqlens_q=[0, 5, 5, 12], seqlens_k=[300, 10, 7]))
    assert seeded is batch and batch.max_seqlen_k == 300 and batch.total_q == 12
    with pytest.raises(ValueError, match="host view must hold 4 query offsets and 3 KV lengths; got 3 and 3"):
        make_batch().assume_host_view(HostBatchView(cu_seqlens_q=[0, 5, 12], seqlens_k=[300, 10, 7]))


def test_compatibility_value_checks_run_once_per_batch(monkeypatch):
    batch = PagedPrefillBatch.contiguous([200], [500])
    index = full_index(batch, group=4, hkv=2)
    calls = []
    original = BlockIndex._causal_violations
    monkeypatch.setattr(BlockIndex, "_causal_violations", lambda self, b: calls.append(b) or original(self, b))
    index.check_compatible(batch, 4, tile_size=128)
    index.check_compatible(batch, 4, tile_size=128)  # every layer of a forward: no second device read
    assert len(calls) == 1
    with pytest.raises(ValueError, match="differs from the kernel's query tile 64"):
        index.check_compatible(batch, 4, tile_size=64)  # metadata checks still run every time
    other = PagedPrefillBatch.contiguous([200], [500])
    index.check_compatible(other, 4)
    assert len(calls) == 2
