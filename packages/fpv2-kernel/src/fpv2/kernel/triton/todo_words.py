"""Todo words of the mean correction, built on the device from the block index (no host sync).

The attention kernel walks a segment's eligible blocks ``J < (prefix + p_first) //
block_size`` in steps of pooled vectors and needs, per step, which of them are
pruned ("todo"). Deriving that inside the attention kernel means a scan of the
sorted kept list whose position depends on the previous step: a chain of
dependent loads and reductions that keeps the correction loop from being
software-pipelined. This small kernel writes the words once instead, in the
layout of :class:`fpv2.kernel.CorrectionPlan` (bit ``i`` of word ``w`` of a
segment is set when block ``64 w + i`` is eligible and not kept), so every step
of the attention kernel reads its word at an address known in advance.

One program per segment; every segment gets the same number of words (enough for
the batch's longest request), so the word offsets are ``s * n_words`` and need no
prefix sum. Words past a segment's eligible range are zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contracts import CORRECTION_CHUNK, BlockIndex, PagedPrefillBatch, num_key_blocks
from .sparse_attention import _segment

#: Kept ids read per iteration of a segment's list.
IDS_PER_STEP = 64


@triton.jit
def todo_words_kernel(
    IdxOffsets,
    IdxBlocks,
    SegRequest,
    TileOffsets,
    CuSeqlensQ,
    SeqlensK,
    Words,
    n_words,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WORDS_P2: tl.constexpr,
    IDS: tl.constexpr,
):
    """Words ``Words[pid * n_words : (pid + 1) * n_words]`` of segment ``pid`` (int64, two's complement).

    ``WORDS_P2`` is a power of two >= ``n_words``. Kept ids are distinct, so summing
    their bits is the same as or-ing them.
    """
    pid = tl.program_id(0)
    _b, _h, t, _q0, q_len, kv_len = _segment(pid, SegRequest, TileOffsets, CuSeqlensQ, SeqlensK, NUM_KV_HEADS, False)
    n_elig = (kv_len - q_len + (t * TILE_SIZE) // GROUP) // BLOCK_SIZE
    seg_start = tl.load(IdxOffsets + pid)
    seg_end = tl.load(IdxOffsets + pid + 1)
    offs_w = tl.arange(0, WORDS_P2)
    offs_i = tl.arange(0, IDS)
    one = tl.full([IDS], 1, tl.int64)
    kept = tl.zeros([WORDS_P2], tl.int64)
    for i in range(seg_start, seg_end, IDS):
        pos = i + offs_i
        ids = tl.load(IdxBlocks + pos, mask=pos < seg_end, other=0)
        valid = (pos < seg_end) & (ids >= 0) & (ids < n_elig)
        word_of = tl.where(valid, ids // 64, -1)
        bit = one << tl.where(valid, ids % 64, 0).to(tl.int64)
        kept += tl.sum(tl.where(word_of[:, None] == offs_w[None, :], bit[:, None], 0), 0)
    # eligible bits of word w: the low clamp(n_elig - 64 w, 0, 64) bits
    n_bits = tl.minimum(tl.maximum(n_elig - 64 * offs_w, 0), 64).to(tl.int64)
    all_ones = tl.full([WORDS_P2], -1, tl.int64)
    eligible = tl.where(n_bits >= 64, all_ones, ~(all_ones << tl.minimum(n_bits, 63)))
    tl.store(Words + pid.to(tl.int64) * n_words + offs_w, eligible & ~kept, mask=offs_w < n_words)


def todo_words(
    index: BlockIndex, batch: PagedPrefillBatch, seg_request: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The correction plan's todo words of every segment of ``index``, computed on the device.

    Args:
        index: the block index (assumed checked against ``batch``).
        batch: the batch the index was built for; its cached host view gives the word count.
        seg_request: ``(S,) int32`` request of each segment, if the caller has it already.

    Returns:
        ``(todo_offsets (S+1,) int32, todo_masks (S * n_words,) int64)`` in the layout of
        :class:`fpv2.kernel.CorrectionPlan`, where ``n_words`` covers the longest request.
        No host sync beyond the batch's cached host view.
    """
    device = index.offsets.device
    num_segments = index.num_segments
    max_blocks = max((num_key_blocks(k, index.block_size) for k in batch.host.seqlens_k), default=0)
    n_words = -(-max_blocks // CORRECTION_CHUNK)
    offsets = torch.arange(num_segments + 1, dtype=torch.int32, device=device) * n_words
    words = torch.empty(num_segments * n_words, dtype=torch.int64, device=device)
    if words.numel() == 0:
        return offsets, words
    if seg_request is None:
        seg_request = segment_requests(index.tile_offsets, index.num_kv_heads, num_segments)
    todo_words_kernel[(num_segments,)](
        index.offsets,
        index.blocks,
        seg_request,
        index.tile_offsets,
        batch.cu_seqlens_q,
        batch.seqlens_k,
        words,
        n_words,
        NUM_KV_HEADS=index.num_kv_heads,
        GROUP=index.group,
        TILE_SIZE=index.tile_size,
        BLOCK_SIZE=index.block_size,
        WORDS_P2=max(16, triton.next_power_of_2(n_words)),
        IDS=IDS_PER_STEP,
        num_warps=4,
    )
    return offsets, words


def segment_requests(tile_offsets: torch.Tensor, num_kv_heads: int, num_segments: int) -> torch.Tensor:
    """``(S,) int32``: the request of each segment, from the cumulative tile counts (on the device).

    Args:
        tile_offsets: ``(B+1,) int32`` cumulative query tiles per request (per KV head).
        num_kv_heads: ``Hkv``.
        num_segments: ``S`` (a host value).

    Returns:
        The request index of every segment in the index's segment order.
    """
    segment_ends = tile_offsets[1:] * num_kv_heads
    return torch.searchsorted(
        segment_ends,
        torch.arange(num_segments, dtype=torch.int32, device=tile_offsets.device),
        right=True,
        out_int32=True,
    )
