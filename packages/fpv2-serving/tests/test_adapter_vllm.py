"""The fpv2 vLLM v1 backend: metadata conversion, KV write, split forward, and vLLM's real interfaces.

Tests in the first part need no vLLM: they drive the vLLM-free modules with
tensors shaped like vLLM 0.33's (``query_start_loc``, ``seq_lens``, block
table, slot mapping, the ``(num_blocks, Hkv, block_size, 2 * d)`` cache in both
of its physical layouts). Tests in the second part use vLLM's own classes
(registry, ``CommonAttentionMetadata``, ``VllmConfig``, the Triton metadata
builder, the ``Attention`` layer) and are skipped, with the import error as the
reason, where vLLM 0.33's interface modules do not import. Nothing here runs
vLLM's dense GPU kernels or an engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fpv2.index import SelectionConfig
from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.reference.paged import gather_kv
from fpv2.kernel.testing import planted_workload
from fpv2.serving import SparsePrefillPipeline
from fpv2.serving.adapters.vllm_forward import forward_split_batch
from fpv2.serving.adapters.vllm_kv_cache import kv_cache_views, paged_as_kv_cache, write_kv_cache
from fpv2.serving.adapters.vllm_metadata import (
    BatchSplit,
    Fpv2VllmMetadata,
    VllmPrefillPart,
    host_view_from_vllm,
    prefill_batch_from_vllm,
    split_decode_prefill,
)
from fpv2.serving.adapters.vllm_options import VllmAdapterOptions, load_options
from fpv2.serving.adapters.vllm_plugin import (
    BACKEND_CLASS_PATH,
    ENTRY_POINT_GROUP,
    ENTRY_POINT_NAME,
    ENTRY_POINT_VALUE,
)

HQ, HKV, D, BS = 4, 2, 64, 16
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


# ----------------------------------------------------------------------------- a vLLM-shaped step
@dataclass
class Step:
    """One vLLM step: packed new tokens (decodes first), full K/V per request, vLLM's index arrays."""

    q: torch.Tensor  # (T, Hq, d) new queries, packed
    k_new: torch.Tensor  # (T, Hkv, d) new keys
    v_new: torch.Tensor
    k_full: list[torch.Tensor]  # per request (seq_len, Hkv, d): cached prefix + new tokens
    v_full: list[torch.Tensor]
    q_lens: list[int]
    seq_lens_list: list[int]
    query_start_loc: torch.Tensor  # (B+1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    block_table: torch.Tensor  # (B, max_blocks) int32
    slot_mapping: torch.Tensor  # (T,) int64
    num_blocks: int


def make_step(q_lens, prefix_lens, *, num_blocks=40, seed=0, dtype=torch.float32) -> Step:
    gen = torch.Generator().manual_seed(seed)
    seq = [p + q for p, q in zip(prefix_lens, q_lens)]
    need = [-(-s // BS) for s in seq]
    assert sum(need) <= num_blocks
    # Scrambled, distinct block ids: the block table must matter.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + 1  # one spare column, as vLLM's tables are wider than needed
    table = torch.zeros(len(q_lens), width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[start : start + n], dtype=torch.int32)
        start += n
    k_full = [torch.randn(s, HKV, D, generator=gen).to(dtype) for s in seq]
    v_full = [torch.randn(s, HKV, D, generator=gen).to(dtype) for s in seq]
    slots, k_new, v_new = [], [], []
    for b, (p, s) in enumerate(zip(prefix_lens, seq)):
        pos = torch.arange(p, s)
        slots.append(table[b, pos // BS].long() * BS + pos % BS)
        k_new.append(k_full[b][p:])
        v_new.append(v_full[b][p:])
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    return Step(
        q=torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype),
        k_new=torch.cat(k_new),
        v_new=torch.cat(v_new),
        k_full=k_full,
        v_full=v_full,
        q_lens=list(q_lens),
        seq_lens_list=seq,
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.cat(slots),
        num_blocks=num_blocks,
    )


def empty_cache(num_blocks: int, layout: str, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """vLLM's logical (num_blocks, Hkv, block_size, 2d) cache, head-major (HND) or token-major (NHD) in memory."""
    if layout == "HND":
        return torch.zeros(num_blocks, HKV, BS, 2 * D, dtype=dtype, device=device)
    return torch.zeros(num_blocks, BS, HKV, 2 * D, dtype=dtype, device=device).transpose(1, 2)


def write_prefixes(kv_cache: torch.Tensor, step: Step) -> None:
    """Place the cached prefixes (earlier steps) by direct indexing of vLLM's logical layout."""
    for b, (s, q) in enumerate(zip(step.seq_lens_list, step.q_lens)):
        pos = torch.arange(s - q)
        blk = step.block_table[b, pos // BS].long().to(kv_cache.device)
        off = (pos % BS).to(kv_cache.device)
        kv_cache[blk, :, off, :D] = step.k_full[b][: s - q].to(kv_cache.device)
        kv_cache[blk, :, off, D:] = step.v_full[b][: s - q].to(kv_cache.device)


def dense_reference(step: Step, requests: list[int]) -> torch.Tensor:
    """fpv2's dense reference on the requests' own contiguous K/V (no vLLM layout, no block table)."""
    qsl = step.query_start_loc.tolist()
    q = torch.cat([step.q[qsl[b] : qsl[b + 1]] for b in requests])
    k = torch.cat([step.k_full[b] for b in requests]).unsqueeze(1)
    v = torch.cat([step.v_full[b] for b in requests]).unsqueeze(1)
    batch = PagedPrefillBatch.contiguous(
        [step.q_lens[b] for b in requests], [step.seq_lens_list[b] for b in requests], page_size=1
    )
    return dense_attention(q, k, v, batch)


def metadata_for(step: Step, decode_threshold: int = 1, decode=None, device="cpu") -> Fpv2VllmMetadata:
    """The metadata the builder makes, from the vLLM-free pieces (device arrays plus their CPU copies)."""
    split = split_decode_prefill(step.query_start_loc, decode_threshold)
    prefill = None
    if split.num_prefills:
        prefill = VllmPrefillPart(
            query_start_loc=step.query_start_loc.to(device),
            seq_lens=step.seq_lens.to(device),
            block_table=step.block_table.to(device),
            first_prefill=split.num_decodes,
            host=host_view_from_vllm(step.query_start_loc, step.seq_lens, split.num_decodes),
        )
    return Fpv2VllmMetadata(
        split=split,
        num_actual_tokens=step.q.shape[0],
        slot_mapping=step.slot_mapping.to(device),
        prefill=prefill,
        decode=decode,
    )


DENSE = SparsePrefillPipeline(strategy="dense", correction=False, backend="reference")


# ----------------------------------------------------------------------------- options
def test_options_defaults_and_environment():
    assert VllmAdapterOptions.from_env({}) == VllmAdapterOptions()
    opts = VllmAdapterOptions.from_env(
        {
            "FPV2_VLLM_STRATEGY": "dense",
            "FPV2_VLLM_CORRECTION": "0",
            "FPV2_VLLM_DECODE_BACKEND": "TRITON_ATTN",
            "FPV2_VLLM_ALPHA": "0.12",
            "FPV2_VLLM_MIN_SPARSE_KV_LEN": "4096",
            "FPV2_VLLM_CHECK_VALUES": "true",
            "UNRELATED": "x",
        }
    )
    assert opts.strategy == "dense" and opts.correction is False and opts.check_values is True
    assert opts.decode_backend == "TRITON_ATTN"
    assert opts.config == SelectionConfig(alpha=0.12, min_sparse_kv_len=4096)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"FPV2_VLLM_ALPAH": "0.1"}, "FPV2_VLLM_ALPAH"),
        ({"FPV2_VLLM_MIN_SPARSE_KV_LEN": "8k"}, "FPV2_VLLM_MIN_SPARSE_KV_LEN"),
        ({"FPV2_VLLM_CORRECTION": "maybe"}, "FPV2_VLLM_CORRECTION"),
        ({"FPV2_VLLM_SOFTMAX_SCALE": "0.1"}, "FPV2_VLLM_SOFTMAX_SCALE"),
        ({"FPV2_VLLM_STRATEGY": "nope"}, "nope"),
        ({"FPV2_VLLM_ALPHA": "2"}, "alpha"),
    ],
)
def test_options_refuse_bad_environment(env, message):
    with pytest.raises(ValueError, match=message):
        VllmAdapterOptions.from_env(env)


# ----------------------------------------------------------------------------- batch split
@pytest.mark.parametrize(
    ("q_lens", "threshold", "expected"),
    [
        ([1, 1, 1], 1, (3, 3, 0, 0)),
        ([40, 29], 1, (0, 0, 2, 69)),
        ([1, 1, 40, 29], 1, (2, 2, 2, 69)),
        ([1, 3, 1, 40], 3, (3, 5, 1, 40)),
        ([1, 3, 1, 40], 1, (1, 1, 3, 44)),  # a later short request after the first prefill counts as prefill
        ([1, 0, 7], 1, (2, 1, 1, 7)),
    ],
)
def test_split_decode_prefill(q_lens, threshold, expected):
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    assert split_decode_prefill(qsl, threshold) == BatchSplit(*expected)


def test_split_refuses_device_mismatch_and_bad_threshold():
    with pytest.raises(ValueError, match="query_start_loc_cpu"):
        split_decode_prefill(torch.tensor([0], dtype=torch.int32))
    with pytest.raises(TypeError, match="query_start_loc_cpu"):
        split_decode_prefill(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="decode_threshold"):
        split_decode_prefill(torch.tensor([0, 1], dtype=torch.int32), 0)


# ----------------------------------------------------------------------------- metadata conversion
def test_prefill_batch_from_two_prefills_one_with_prefix_block16():
    # One decode in front, then a plain 40-token prompt and 29 new tokens on top of a 37-token cached prefix.
    step = make_step([1, 40, 29], [20, 0, 37], seed=1)
    split = split_decode_prefill(step.query_start_loc)
    assert split == BatchSplit(1, 1, 2, 69)
    host = host_view_from_vllm(step.query_start_loc, step.seq_lens, split.num_decodes)
    batch = prefill_batch_from_vllm(
        step.query_start_loc,
        step.seq_lens,
        step.block_table,
        first_prefill=split.num_decodes,
        page_size=BS,
        num_pages=step.num_blocks,
        host=host,
        check_values=True,
    )
    assert batch.cu_seqlens_q.tolist() == [0, 40, 69]
    assert batch.seqlens_k.tolist() == [40, 66]
    assert batch.prefix.tolist() == [0, 37]
    assert batch.page_size == BS and batch.num_pages == step.num_blocks
    assert torch.equal(batch.page_table, step.block_table[1:])
    assert batch.cu_seqlens_q.dtype == batch.seqlens_k.dtype == batch.page_table.dtype == torch.int32
    # The host view came from the CPU copies and agrees with the device arrays.
    assert batch.host.cu_seqlens_q == [0, 40, 69] and batch.host.seqlens_k == [40, 66]
    # Token i of prefill request 1 is where vLLM's slot mapping put it.
    for pos in (0, 15, 16, 36, 37, 65):
        page = int(batch.page_table[1, pos // BS])
        assert page * BS + pos % BS == int(step.block_table[2, pos // BS]) * BS + pos % BS


def test_prefill_batch_refuses_inconsistent_vllm_arrays():
    step = make_step([40, 29], [0, 37], seed=2)
    host = host_view_from_vllm(step.query_start_loc, step.seq_lens, 0)
    with pytest.raises(ValueError, match="block_table too narrow"):
        prefill_batch_from_vllm(
            step.query_start_loc,
            step.seq_lens,
            step.block_table[:, :2],
            first_prefill=0,
            page_size=BS,
            num_pages=step.num_blocks,
            host=host,
        )
    short = host_view_from_vllm(step.query_start_loc, torch.tensor([40, 20], dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="seq_lens"):
        prefill_batch_from_vllm(
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            first_prefill=0,
            page_size=BS,
            num_pages=step.num_blocks,
            host=short,
        )
    with pytest.raises(ValueError, match="page id out of range"):
        prefill_batch_from_vllm(
            step.query_start_loc,
            step.seq_lens,
            step.block_table,
            first_prefill=0,
            page_size=BS,
            num_pages=3,
            check_values=True,
        )
    with pytest.raises(ValueError, match="first_prefill"):
        prefill_batch_from_vllm(
            step.query_start_loc, step.seq_lens, step.block_table, first_prefill=2, page_size=BS, num_pages=40
        )
    with pytest.raises(TypeError, match="block_table"):
        prefill_batch_from_vllm(
            step.query_start_loc, step.seq_lens, step.block_table.float(), first_prefill=0, page_size=BS, num_pages=40
        )


# ----------------------------------------------------------------------------- KV write
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_write_kv_cache_at_slot_mapping(layout):
    step = make_step([5, 20], [3, 11], seed=3)
    kv_cache = empty_cache(step.num_blocks, layout)
    kv_cache.copy_(torch.randn(kv_cache.shape))
    before = kv_cache.clone()
    # vLLM pads: a negative slot is not stored, and key/value rows past the slot mapping are padding.
    slots = step.slot_mapping.clone()
    slots[2] = -1
    pad = torch.full((3, HKV, D), 1e6)
    write_kv_cache(torch.cat([step.k_new, pad]), torch.cat([step.v_new, pad]), kv_cache, slots)
    touched = torch.zeros(step.num_blocks, BS, dtype=torch.bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, BS)
        touched[blk, off] = True
        assert torch.equal(kv_cache[blk, :, off, :D], step.k_new[i])
        assert torch.equal(kv_cache[blk, :, off, D:], step.v_new[i])
    untouched = ~touched[:, None, :, None].expand(kv_cache.shape)
    assert torch.equal(kv_cache[untouched], before[untouched])
    # The views the fpv2 kernels read see the same tokens.
    k_cache, v_cache = kv_cache_views(kv_cache, D)
    assert k_cache.shape == (step.num_blocks, BS, HKV, D) and k_cache.stride(-1) == 1
    blk, off = divmod(int(step.slot_mapping[7]), BS)
    assert torch.equal(k_cache[blk, off], step.k_new[7]) and torch.equal(v_cache[blk, off], step.v_new[7])


def test_write_kv_cache_refuses_bad_inputs():
    step = make_step([4], [0], seed=4, num_blocks=2)
    kv_cache = empty_cache(2, "HND")
    with pytest.raises(TypeError, match="key must have the cache's dtype"):
        write_kv_cache(step.k_new.half(), step.v_new.half(), kv_cache, step.slot_mapping)
    with pytest.raises(ValueError, match="slot 32"):
        write_kv_cache(step.k_new, step.v_new, kv_cache, torch.tensor([0, 1, 2, 32]))
    with pytest.raises(ValueError, match="2 \\* head_size"):
        kv_cache_views(kv_cache, 32)


@pytest.mark.parametrize(("layout", "head_stride"), [("NHD", 2 * D), ("HND", BS * 2 * D)])
def test_paged_as_kv_cache_inverts_the_views(layout, head_stride):
    k = torch.randn(3, BS, HKV, D)
    v = torch.randn(3, BS, HKV, D)
    kv_cache = paged_as_kv_cache(k, v, layout)
    assert kv_cache.shape == (3, HKV, BS, 2 * D)
    k_view, v_view = kv_cache_views(kv_cache, D)
    assert torch.equal(k_view, k) and torch.equal(v_view, v)
    assert k_view.stride() == (BS * HKV * 2 * D, 2 * D if layout == "HND" else HKV * 2 * D, head_stride, 1)
    with pytest.raises(ValueError, match="layout must be one of"):
        paged_as_kv_cache(k, v, "DHN")
    with pytest.raises(ValueError, match="share one"):
        paged_as_kv_cache(k, v[:2])
    with pytest.raises(TypeError, match="dtype"):
        paged_as_kv_cache(k, v.half())


# ----------------------------------------------------------------------------- prefill forward
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_prefill_forward_equals_dense_reference(layout):
    step = make_step([40, 29], [0, 37], seed=5)
    kv_cache = empty_cache(step.num_blocks, layout)
    write_prefixes(kv_cache, step)
    write_kv_cache(step.k_new, step.v_new, kv_cache, step.slot_mapping)
    out = torch.full_like(step.q, float("nan"))
    forward_split_batch(
        step.q, kv_cache, metadata_for(step), out, head_size=D, pipeline=DENSE, decode=None, prefill_hook=None
    )
    ref = dense_reference(step, [0, 1])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_sparse_prefill_on_vllm_cache_equals_pipeline_on_own_cache():
    # A planted workload where the index really prunes; its tokens copied into a vLLM cache with
    # another block table must give the same index and output as the pipeline on the original cache.
    wl = planted_workload(
        [400, 512], [700, 512], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=BS, dtype=torch.float32
    )
    # No sink or window blocks, so that these short requests have blocks to prune.
    config = SelectionConfig(alpha=0.1, sink_tokens=0, window_tokens=0, min_sparse_kv_len=0)
    pipeline = SparsePrefillPipeline(config, strategy="max_threshold", correction=True, backend="reference")
    expected = pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert expected.index.density(wl.batch) < 0.8

    step = make_step([400, 512], [300, 0], num_blocks=80, seed=6)
    kv_cache = empty_cache(step.num_blocks, "NHD")
    for b in range(2):
        step.k_full[b] = gather_kv(wl.k_cache, wl.batch, b)
        step.v_full[b] = gather_kv(wl.v_cache, wl.batch, b)
    write_prefixes(kv_cache, step)
    qsl = step.query_start_loc.tolist()
    prefixes = [300, 0]
    new_k = torch.cat([step.k_full[b][prefixes[b] :] for b in range(2)])
    new_v = torch.cat([step.v_full[b][prefixes[b] :] for b in range(2)])
    write_kv_cache(new_k, new_v, kv_cache, step.slot_mapping)
    results = []
    out = torch.empty_like(wl.q)
    forward_split_batch(
        wl.q,
        kv_cache,
        metadata_for(step),
        out,
        head_size=D,
        pipeline=pipeline,
        decode=None,
        prefill_hook=results.append,
    )
    assert qsl == [0, 400, 912] and len(results) == 1
    assert torch.equal(results[0].index.kept, expected.index.kept)
    assert torch.equal(results[0].index.offsets, expected.index.offsets)
    torch.testing.assert_close(out, expected.out, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- mixed batches
def test_mixed_batch_rows_go_to_decode_and_prefill_paths():
    # Two decodes (1 token each, on 20- and 33-token contexts), then two prefills, then 3 padding rows.
    step = make_step([1, 1, 40, 29], [19, 32, 0, 37], seed=7)
    kv_cache = empty_cache(step.num_blocks, "HND")
    write_prefixes(kv_cache, step)
    write_kv_cache(step.k_new, step.v_new, kv_cache, step.slot_mapping)
    query = torch.cat([step.q, torch.randn(3, HQ, D)])
    out = torch.full_like(query, float("nan"))
    calls = []
    decode_ref = dense_reference(step, [0, 1])

    def decode(q_rows, out_rows):
        calls.append((q_rows.data_ptr(), q_rows.shape, out_rows.data_ptr(), out_rows.shape))
        out_rows.copy_(decode_ref)

    metadata = metadata_for(step, decode="decode-metadata")
    assert metadata.split == BatchSplit(2, 2, 2, 69)
    forward_split_batch(query, kv_cache, metadata, out, head_size=D, pipeline=DENSE, decode=decode)
    assert calls == [(query.data_ptr(), (2, HQ, D), out.data_ptr(), (2, HQ, D))]
    torch.testing.assert_close(out[:2], decode_ref)
    torch.testing.assert_close(out[2:71], dense_reference(step, [2, 3]), atol=2e-5, rtol=2e-5)
    assert torch.isnan(out[71:]).all()  # padding rows untouched


def test_mixed_batch_without_decode_path_is_refused():
    step = make_step([1, 40], [10, 0], seed=8)
    kv_cache = empty_cache(step.num_blocks, "HND")
    with pytest.raises(RuntimeError, match="1 decode rows"):
        forward_split_batch(
            step.q, kv_cache, metadata_for(step), torch.empty_like(step.q), head_size=D, pipeline=DENSE, decode=None
        )


def test_pyproject_declares_vllm_entry_point():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    entry_points = tomllib.loads(PYPROJECT.read_text())["project"].get("entry-points", {})
    assert entry_points.get(ENTRY_POINT_GROUP, {}).get(ENTRY_POINT_NAME) == ENTRY_POINT_VALUE, (
        f'{PYPROJECT} must declare [project.entry-points."{ENTRY_POINT_GROUP}"] '
        f'{ENTRY_POINT_NAME} = "{ENTRY_POINT_VALUE}"'
    )


def _triton_ready() -> bool:
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_ready(), reason="needs Triton with a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_triton_backend_reads_vllm_cache_layouts(layout):
    # The fpv2 Triton kernels (pooling, attention) walk vLLM's strided cache views directly.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    step = make_step([40, 29], [0, 37], seed=15, dtype=torch.float16)
    kv_cache = empty_cache(step.num_blocks, layout, torch.float16, device)
    write_prefixes(kv_cache, step)
    write_kv_cache(step.k_new.to(device), step.v_new.to(device), kv_cache, step.slot_mapping.to(device))
    pipeline = SparsePrefillPipeline(
        SelectionConfig(min_sparse_kv_len=0, sink_tokens=0, window_tokens=0), correction=True, backend="triton"
    )
    out = torch.empty_like(step.q, device=device)
    forward_split_batch(
        step.q.to(device), kv_cache, metadata_for(step, device=device), out, head_size=D, pipeline=pipeline, decode=None
    )
    torch.testing.assert_close(out.float().cpu(), dense_reference(step, [0, 1]), atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_default_pipeline_on_vllm_cache_equals_own_cache(layout):
    # Default selection (sparse above 8K tokens), auto backend, bf16: a 12K-token request on top of an
    # 8K prefix and a short one, read through vLLM's cache views, must match the pipeline on its own cache.
    wl = planted_workload(
        [4096, 1024], [12288, 1024], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=BS, device="cuda"
    )
    pipeline = SparsePrefillPipeline()
    expected = pipeline(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert expected.index.density(wl.batch) < 0.9
    step = make_step([4096, 1024], [8192, 0], num_blocks=900, seed=16, dtype=torch.bfloat16)
    for b in range(2):
        step.k_full[b] = gather_kv(wl.k_cache, wl.batch, b).cpu()
        step.v_full[b] = gather_kv(wl.v_cache, wl.batch, b).cpu()
    step.q_lens = [4096, 1024]
    kv_cache = empty_cache(step.num_blocks, layout, torch.bfloat16, "cuda")
    write_prefixes(kv_cache, step)
    prefixes = [8192, 0]
    new_k = torch.cat([step.k_full[b][prefixes[b] :] for b in range(2)]).cuda()
    new_v = torch.cat([step.v_full[b][prefixes[b] :] for b in range(2)]).cuda()
    write_kv_cache(new_k, new_v, kv_cache, step.slot_mapping.cuda())
    results = []
    out = torch.empty_like(wl.q)
    forward_split_batch(
        wl.q,
        kv_cache,
        metadata_for(step, device="cuda"),
        out,
        head_size=D,
        pipeline=pipeline,
        decode=None,
        prefill_hook=results.append,
    )
    index = results[0].index
    assert torch.equal(index.offsets, expected.index.offsets) and torch.equal(index.kept, expected.index.kept)
    torch.testing.assert_close(out.float(), expected.out.float(), atol=2e-2, rtol=2e-2)


# ============================================================================= with vLLM's own classes
@pytest.fixture(scope="module")
def vllm():
    """vLLM 0.33's interface modules, or a skip naming why they do not import."""
    try:
        from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.forward_context import set_forward_context
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
        from vllm.v1.attention.backends.utils import split_decodes_and_prefills
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from fpv2.serving.adapters.vllm_backend import Fpv2AttentionBackend
        from fpv2.serving.adapters.vllm_builder import Fpv2MetadataBuilder
        from fpv2.serving.adapters.vllm_impl import Fpv2AttentionImpl
        from fpv2.serving.adapters.vllm_plugin import register
    except Exception as exc:  # any failure of vLLM's import chain means: not testable here
        pytest.skip(f"needs vLLM 0.33's attention interfaces, which do not import here: {type(exc).__name__}: {exc}")
    return SimpleNamespace(
        CacheConfig=CacheConfig,
        DeviceConfig=DeviceConfig,
        ModelConfig=ModelConfig,
        VllmConfig=VllmConfig,
        set_current_vllm_config=set_current_vllm_config,
        set_forward_context=set_forward_context,
        Attention=Attention,
        DeviceCapability=DeviceCapability,
        CommonAttentionMetadata=CommonAttentionMetadata,
        AttentionBackendEnum=AttentionBackendEnum,
        TritonAttentionMetadata=TritonAttentionMetadata,
        split_decodes_and_prefills=split_decodes_and_prefills,
        FullAttentionSpec=FullAttentionSpec,
        Fpv2AttentionBackend=Fpv2AttentionBackend,
        Fpv2MetadataBuilder=Fpv2MetadataBuilder,
        Fpv2AttentionImpl=Fpv2AttentionImpl,
        register=register,
    )


@pytest.fixture
def vllm_config(vllm, tmp_path):
    """A VllmConfig for a tiny local Llama-shaped config (4 query heads over 2 KV heads, d=64), on the CPU."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HQ * D,
        "intermediate_size": 512,
        "num_attention_heads": HQ,
        "num_key_value_heads": HKV,
        "head_dim": D,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = vllm.ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32")
    return vllm.VllmConfig(
        model_config=model, device_config=vllm.DeviceConfig(device="cpu"), cache_config=vllm.CacheConfig(block_size=BS)
    )


def common_metadata(vllm, step: Step):
    qsl = step.query_start_loc
    return vllm.CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=step.seq_lens,
        num_reqs=len(step.q_lens),
        num_actual_tokens=step.q.shape[0],
        max_query_len=max(step.q_lens),
        max_seq_len=max(step.seq_lens_list),
        block_table_tensor=step.block_table,
        slot_mapping=step.slot_mapping,
        seq_lens_cpu_upper_bound=step.seq_lens.clone(),
    )


def make_builder(vllm, vllm_config, layer_name="layer.0", options=None):
    spec = vllm.FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    return vllm.Fpv2MetadataBuilder(spec, [layer_name], vllm_config, torch.device("cpu"), options=options)


@pytest.fixture
def custom_backend_slot(vllm):
    """Leaves vLLM's CUSTOM registration as it was found."""
    custom = vllm.AttentionBackendEnum.CUSTOM
    from vllm.v1.attention.backends import registry

    saved = registry._ATTN_OVERRIDES.get(custom)
    custom.clear_override()
    yield custom
    custom.clear_override()
    if saved is not None:
        registry._ATTN_OVERRIDES[custom] = saved


def test_plugin_registers_the_backend_as_custom(vllm, custom_backend_slot):
    # What vLLM does with the entry point: load the target and call it (possibly more than once).
    plugin = EntryPoint(name=ENTRY_POINT_NAME, value=ENTRY_POINT_VALUE, group=ENTRY_POINT_GROUP).load()
    assert plugin is vllm.register
    assert plugin() is True and plugin() is True
    assert custom_backend_slot.get_path() == BACKEND_CLASS_PATH
    backend = custom_backend_slot.get_class()
    assert backend is vllm.Fpv2AttentionBackend
    # vLLM's Attention layer maps get_name() back to the enum member.
    assert vllm.AttentionBackendEnum[backend.get_name()] is custom_backend_slot
    assert backend.get_impl_cls() is vllm.Fpv2AttentionImpl and backend.get_builder_cls() is vllm.Fpv2MetadataBuilder
    assert backend.forward_includes_kv_cache_update is False


def test_plugin_keeps_a_foreign_custom_backend(vllm, custom_backend_slot):
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(custom_backend_slot, "someone.else.Backend")
    assert vllm.register() is False
    assert custom_backend_slot.get_path() == "someone.else.Backend"


def test_backend_configuration_checks(vllm):
    backend = vllm.Fpv2AttentionBackend
    base = dict(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=vllm.DeviceCapability(9, 0),
        attn_type="decoder",
    )
    assert backend.validate_configuration(**base) == []
    assert "head_size not supported" in backend.validate_configuration(**{**base, "head_size": 96})
    assert "kv_cache_dtype not supported" in backend.validate_configuration(**{**base, "kv_cache_dtype": "fp8"})
    assert "sliding window not supported" in backend.validate_configuration(**base, has_sliding_window=True)
    assert "attention sinks not supported" in backend.validate_configuration(**{**base, "has_sink": True})
    assert any("encoder" in r for r in backend.validate_configuration(**{**base, "attn_type": "encoder"}))
    assert not backend.supports_device_cpu_query_lens_mismatch()


@pytest.mark.parametrize("kwargs", [{"sliding_window": 4096}, {"alibi_slopes": [1.0] * HQ}, {"kv_cache_dtype": "fp8"}])
def test_impl_refuses_unsupported_features(vllm, kwargs):
    with pytest.raises(NotImplementedError, match=next(iter(kwargs))):
        vllm.Fpv2AttentionImpl(HQ, D, D**-0.5, HKV, **kwargs)


def test_split_agrees_with_vllm(vllm):
    for q_lens, prefixes in (([1, 1, 40, 29], [19, 32, 0, 37]), ([40, 29], [0, 37]), ([1, 1], [5, 9])):
        step = make_step(q_lens, prefixes, seed=9)
        common = common_metadata(vllm, step)
        ours = split_decode_prefill(step.query_start_loc, 1)
        theirs = vllm.split_decodes_and_prefills(common, decode_threshold=1)
        assert (ours.num_decodes, ours.num_prefills, ours.num_decode_tokens, ours.num_prefill_tokens) == theirs


def test_builder_on_vllm_common_metadata(vllm, vllm_config):
    options = VllmAdapterOptions(decode_backend="TRITON_ATTN")
    builder = make_builder(vllm, vllm_config, options=options)
    assert builder.reorder_batch_threshold == 1
    step = make_step([1, 1, 40, 29], [19, 32, 0, 37], seed=10)
    meta = builder.build(0, common_metadata(vllm, step))
    assert meta.split == BatchSplit(2, 2, 2, 69)
    assert meta.num_actual_tokens == 71 and meta.slot_mapping is step.slot_mapping
    # Decode rows: vLLM's own Triton metadata for the two decode requests only.
    assert isinstance(meta.decode, vllm.TritonAttentionMetadata)
    assert meta.decode.num_actual_tokens == 2 and meta.decode.max_query_len == 1
    assert meta.decode.query_start_loc.tolist() == [0, 1, 2]
    assert meta.decode.seq_lens.tolist() == [20, 33]
    assert torch.equal(meta.decode.block_table, step.block_table[:2])
    # Prefill rows: the paged batch of the other two, page size = block size, the cache's block count.
    batch = meta.prefill.batch(num_pages=step.num_blocks, page_size=BS)
    assert batch is meta.prefill.batch(num_pages=step.num_blocks, page_size=BS)  # built once per step
    assert batch.cu_seqlens_q.tolist() == [0, 40, 69] and batch.seqlens_k.tolist() == [40, 66]
    assert batch.prefix.tolist() == [0, 37] and torch.equal(batch.page_table, step.block_table[2:])
    # A decode-only step has no prefill part, a prefill-only step no decode part.
    only_decodes = builder.build(0, common_metadata(vllm, make_step([1, 1], [4, 8], seed=11)))
    assert only_decodes.prefill is None and only_decodes.decode is not None
    only_prefills = builder.build(0, common_metadata(vllm, make_step([40, 29], [0, 37], seed=12)))
    assert only_prefills.decode is None and only_prefills.prefill.first_prefill == 0


@pytest.fixture
def dense_env(monkeypatch):
    """Adapter options from the environment, as vLLM's workers get them: dense strategy, no correction."""
    monkeypatch.setenv("FPV2_VLLM_STRATEGY", "dense")
    monkeypatch.setenv("FPV2_VLLM_CORRECTION", "0")
    monkeypatch.setenv("FPV2_VLLM_BACKEND", "reference")
    load_options.cache_clear()
    yield
    load_options.cache_clear()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_vllm_attention_layer_runs_fpv2_prefill(vllm, vllm_config, dense_env, layout):
    # vLLM's own Attention layer with this backend: vLLM calls do_kv_cache_update (slot mapping from
    # the forward context), then forward with the builder's metadata. Prefill-only: on the CPU.
    name = "model.layers.0.self_attn.attn"
    with vllm.set_current_vllm_config(vllm_config):
        layer = vllm.Attention(HQ, D, D**-0.5, num_kv_heads=HKV, prefix=name, attn_backend=vllm.Fpv2AttentionBackend)
    assert isinstance(layer.impl, vllm.Fpv2AttentionImpl)
    assert layer.impl.pipeline.strategy == "dense" and layer.impl.pipeline.correction is False
    step = make_step([40, 29], [0, 37], seed=13)
    kv_cache = empty_cache(step.num_blocks, layout)
    write_prefixes(kv_cache, step)
    layer.kv_cache = kv_cache
    meta = make_builder(vllm, vllm_config, name).build(0, common_metadata(vllm, step))
    with vllm.set_forward_context({name: meta}, vllm_config, slot_mapping={name: step.slot_mapping}):
        out = layer(step.q.reshape(-1, HQ * D), step.k_new.reshape(-1, HKV * D), step.v_new.reshape(-1, HKV * D))
    for i, slot in enumerate(step.slot_mapping.tolist()):  # the KV write happened, at vLLM's slots
        blk, off = divmod(slot, BS)
        assert torch.equal(kv_cache[blk, :, off, :D], step.k_new[i])
        assert torch.equal(kv_cache[blk, :, off, D:], step.v_new[i])
    torch.testing.assert_close(out.view(-1, HQ, D), dense_reference(step, [0, 1]), atol=2e-5, rtol=2e-5)


def test_impl_refuses_decode_rows_on_cpu(vllm, vllm_config):
    options = VllmAdapterOptions(strategy="dense", correction=False, backend="reference", decode_backend="TRITON_ATTN")
    impl = vllm.Fpv2AttentionImpl(HQ, D, D**-0.5, HKV, options=options)
    step = make_step([1, 40], [10, 0], seed=14)
    meta = make_builder(vllm, vllm_config, options=options).build(0, common_metadata(vllm, step))
    kv_cache = empty_cache(step.num_blocks, "HND")
    layer = SimpleNamespace(_q_scale=torch.ones(()), _k_scale=torch.ones(()), _v_scale=torch.ones(()))
    impl.do_kv_cache_update(layer, step.k_new, step.v_new, kv_cache, step.slot_mapping)
    with pytest.raises(RuntimeError, match="TRITON_ATTN backend, whose kernels need a GPU"):
        impl.forward(layer, step.q, step.k_new, step.v_new, kv_cache, meta, torch.empty_like(step.q))
    # vLLM's profiling run passes no metadata: the output is zeroed, nothing else happens.
    out = torch.full_like(step.q, 3.0)
    assert impl.forward(layer, step.q, None, None, kv_cache, None, out) is out and not out.any()
