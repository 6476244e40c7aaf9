"""Block-sparse attention over a CSR block index, with the optional mean correction (reference).

For each segment (request ``b``, KV head ``h``, tile ``t``) of a
:class:`~fpv2.kernel.contracts.BlockIndex`, the tile's PackGQA rows attend
exactly (one softmax, no online rescaling) to the tokens of the kept blocks,
with the causal mask applied inside the diagonal band. With a
:class:`~fpv2.kernel.contracts.CorrectionPlan`, every *todo* block (eligible
and not kept, see :mod:`.correction_rule`) adds one pseudo-key per row: the
block's pooled key with its logit shifted by ``log |B_J|`` and its pooled
value, which stands for the ``|B_J|`` tokens that were pruned. A plan with a
``key_spread`` adds the second-order mass shift to those logits (:mod:`.mass_shift`).
"""

from __future__ import annotations

import itertools
import math

import torch

from ..contracts import (
    CORRECTION_CHUNK,
    BlockIndex,
    BlockStatistics,
    CorrectionPlan,
    KeySpread,
    PagedPrefillBatch,
    PrefillShapes,
    TileSpan,
    cdiv,
    num_key_blocks,
    num_query_tiles,
    tile_span,
    validate_prefill_inputs,
)
from .attention import check_compute_dtype, masked_softmax, request_operands, resolve_scale
from .correction_rule import todo_blocks
from .mass_shift import second_order_shift
from .packgqa import pack_queries, packed_rows_to_position_head


def tile_token_mask(kept: torch.Tensor, span: TileSpan, kv_len: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key tokens of a tile's kept blocks and which of them each row may see.

    Args:
        kept: ``(n,)`` integer tensor of kept block ids (on the compute device).
        span: rows and positions of the tile.
        kv_len: KV length of the request (prefix included).
        group: GQA group size ``g`` (packed row ``r`` is query position ``r // g``).

    Returns:
        ``tokens (n * block_size,) long``: absolute KV positions of the kept blocks,
        clamped into ``0 .. kv_len - 1``; and ``allowed (rows, n * block_size) bool``:
        the token is real (not past the tail of the KV) and causally visible to the row.
    """
    block_size = span.block_size
    device = kept.device
    tokens = (kept.long()[:, None] * block_size + torch.arange(block_size, device=device)).flatten()
    # The tail block is shorter than block_size: its missing tokens are masked, and their
    # index clamped so that nothing past the request's KV is ever read from the cache.
    real = tokens < kv_len
    tokens = tokens.clamp(max=max(kv_len - 1, 0))
    rows = torch.arange(span.row_begin, span.row_end, device=device)
    query_pos = span.prefix + rows // group
    allowed = real[None, :] & (tokens[None, :] <= query_pos[:, None])
    return tokens, allowed


def expand_block_mask(index: BlockIndex, batch: PagedPrefillBatch, request: int, kv_head: int) -> torch.Tensor:
    """The token-level mask (kept blocks AND causal) of one (request, KV head).

    Args:
        index: the block index.
        batch: the batch the index was built for.
        request: request index ``b``.
        kv_head: KV head ``h``.

    Returns:
        ``(q_len * g, kv_len) bool`` on the index's device, rows in PackGQA order
        (row ``r`` is query position ``r // g`` of query head ``h * g + r % g``).

    Raises:
        IndexError: ``request`` or ``kv_head`` out of range.
    """
    if not 0 <= request < batch.num_requests:
        raise IndexError(f"request {request} out of range for a batch of {batch.num_requests}")
    host = batch.host
    q_len, prefix, kv_len = host.q_lens[request], host.prefix[request], host.seqlens_k[request]
    group = index.group
    device = index.blocks.device
    mask = torch.zeros(q_len * group, kv_len, dtype=torch.bool, device=device)
    for t in range(num_query_tiles(q_len, group, index.tile_size)):
        span = tile_span(t, q_len, prefix, group, tile_size=index.tile_size, block_size=index.block_size)
        kept = torch.tensor(index.kept_blocks(request, kv_head, t), dtype=torch.long, device=device)
        tokens, allowed = tile_token_mask(kept, span, kv_len, group)
        # Count permissions per token: clamped tail duplicates carry allowed=False, so the sum
        # is positive exactly where the real token is allowed.
        hits = torch.zeros(span.row_end - span.row_begin, kv_len, dtype=torch.int32, device=device)
        hits.index_add_(1, tokens, allowed.to(torch.int32))
        mask[span.row_begin : span.row_end] = hits > 0
    return mask


def sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    index: BlockIndex,
    *,
    plan: CorrectionPlan | None = None,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each tile over its kept blocks, plus the mean correction when a plan is given.

    A row that sees no key at all (no kept token is causally visible and no todo
    block applies) gets output 0 and lse ``-inf``. Indexes from the selection
    stage always keep the diagonal band, so every row sees at least itself; only a
    hand-made index that drops the diagonal can produce such rows.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache, v_cache: ``(num_pages, page_size, Hkv, d)`` paged cache.
        batch: the batch metadata.
        index: kept blocks per (request, KV head, tile), built for this batch and group.
        plan: mean correction; its statistics must match the index's block size.
            Todo blocks come from ``plan.todo_masks`` when given, else from
            :func:`~fpv2.kernel.reference.correction_rule.todo_blocks`.
        softmax_scale: scale of the logits, ``1 / sqrt(d)`` by default.
        compute_dtype: float32 or float64.
        q_descale, k_descale, v_descale: ``(B, Hkv) float32`` FP8 descales.
        return_lse: also return the log-sum-exp of each row.

    Returns:
        ``out (total_q, Hq, d)`` in ``compute_dtype``; with ``return_lse`` also
        ``lse (total_q, Hq) float32`` (natural log, of the scaled logits, pseudo-keys included).

    Raises:
        TypeError: ``index`` or ``plan`` has the wrong type; invalid tensors.
        ValueError: inputs inconsistent with the batch, an index built for another
            group, tile layout or head count, or a plan that does not fit the index.
    """
    shapes = validate_prefill_inputs(
        q, k_cache, v_cache, batch, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
    )
    check_compute_dtype(compute_dtype)
    scale = resolve_scale(softmax_scale, shapes.head_dim)
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index must be a BlockIndex; got {type(index).__name__}")
    if index.num_kv_heads != shapes.num_kv_heads:
        raise ValueError(
            f"block index has num_kv_heads={index.num_kv_heads}, k_cache has Hkv={shapes.num_kv_heads} "
            f"(shape {tuple(k_cache.shape)})"
        )
    index.check_compatible(batch, shapes.group)
    if plan is not None:
        _check_plan(plan, index, batch, shapes)

    group = shapes.group
    device = q.device
    host = batch.host
    tile_offsets = index.tile_offsets.cpu().tolist()
    offsets = index.offsets.cpu().tolist()
    blocks_host = index.blocks.cpu().tolist()  # kept lists for the todo rule (one sync)
    blocks_dev = index.blocks.to(device)  # kept ids for token gathers (sliced, no sync)
    todo_source = _TodoWords(plan) if plan is not None and plan.todo_masks is not None else None
    block_offsets = plan.statistics.block_offsets.cpu().tolist() if plan is not None else None

    out = torch.zeros(q.shape[0], shapes.num_q_heads, shapes.head_dim, dtype=compute_dtype, device=device)
    lse = torch.full((q.shape[0], shapes.num_q_heads), -math.inf, dtype=torch.float32, device=device)
    for b in range(batch.num_requests):
        q_len, prefix, kv_len, start = host.q_lens[b], host.prefix[b], host.seqlens_k[b], host.cu_seqlens_q[b]
        if q_len == 0:
            continue
        q_b, k_b, v_b = request_operands(
            q, k_cache, v_cache, batch, b, shapes, compute_dtype, (q_descale, k_descale, v_descale)
        )
        ntiles = tile_offsets[b + 1] - tile_offsets[b]
        for h in range(shapes.num_kv_heads):
            packed = pack_queries(q_b, group, h)
            for t in range(ntiles):
                s = index.num_kv_heads * tile_offsets[b] + h * ntiles + t  # SEGMENT_ORDER
                span = tile_span(t, q_len, prefix, group, tile_size=index.tile_size, block_size=index.block_size)
                rows = packed[span.row_begin : span.row_end]

                # Exact attention over the tokens of the kept blocks, causal inside the diagonal band.
                tokens, allowed = tile_token_mask(blocks_dev[offsets[s] : offsets[s + 1]], span, kv_len, group)
                logits = (rows @ k_b[tokens, h].T) * scale
                logits = logits.masked_fill(~allowed, -math.inf)
                values = v_b[tokens, h]

                if plan is not None:
                    kept = blocks_host[offsets[s] : offsets[s + 1]]
                    todo = todo_source.blocks(s, kept, span) if todo_source else todo_blocks(kept, span)
                    if todo:
                        stat_rows = [block_offsets[b] + j for j in todo]  # statistics row of block J
                        extra_logits, extra_values = _pseudo_keys(
                            rows, plan.statistics, stat_rows, h, scale, plan.key_spread
                        )
                        logits = torch.cat([logits, extra_logits], dim=1)
                        values = torch.cat([values, extra_values], dim=0)

                tile_out, tile_lse = masked_softmax(logits, values)
                positions, heads = packed_rows_to_position_head(
                    torch.arange(span.row_begin, span.row_end, device=device), group, h
                )
                out[start + positions, heads] = tile_out
                lse[start + positions, heads] = tile_lse.float()
    return (out, lse) if return_lse else out


def _pseudo_keys(
    rows: torch.Tensor,
    stats: BlockStatistics,
    stat_rows: list[int],
    kv_head: int,
    scale: float,
    spread: KeySpread | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Correction columns of one tile: one pseudo-key per todo block.

    Adding ``log |B_J|`` to the logit makes one softmax column weigh as much as the
    ``|B_J|`` tokens it replaces, each approximated by the block mean:
    ``|B_J| * exp(q . kbar_J * scale) = exp(q . kbar_J * scale + log |B_J|)``. With a
    ``spread`` the logit also gains :func:`~fpv2.kernel.reference.mass_shift.second_order_shift`.

    Args:
        rows: ``(R, d)`` packed query rows of the tile, in the compute dtype.
        stats: pooled keys, values and block lengths.
        stat_rows: statistics rows of the todo blocks (``block_offsets[b] + J``).
        kv_head: KV head ``h``.
        scale: softmax scale.
        spread: the plan's key spread (second-order mass shift), or None.

    Returns:
        ``logits (R, len(stat_rows))`` and ``values (len(stat_rows), d)`` in the dtype of ``rows``.
    """
    device, dtype = rows.device, rows.dtype
    idx = torch.tensor(stat_rows, dtype=torch.long, device=stats.pooled_k.device)
    pooled_k = stats.pooled_k[idx, kv_head].to(device=device, dtype=dtype)
    pooled_v = stats.pooled_v[idx, kv_head].to(device=device, dtype=dtype)
    log_len = torch.log(stats.block_lengths[idx].to(device=device, dtype=dtype))
    logits = (rows @ pooled_k.T) * scale + log_len[None, :]
    if spread is not None:
        logits = logits + second_order_shift(rows, spread.variance[idx, kv_head], spread.radius[idx, kv_head], scale)
    return logits, pooled_v


class _TodoWords:
    """Todo blocks read from a plan's explicit bitmask words (decoded on the host once)."""

    def __init__(self, plan: CorrectionPlan) -> None:
        self.offsets = plan.todo_offsets.cpu().tolist()
        self.words = plan.todo_masks.cpu().tolist()

    def blocks(self, segment: int, kept: list[int], span: TileSpan) -> list[int]:
        """Decode the segment's words into block ids, checking them against the rule they must follow.

        Raises:
            ValueError: wrong word count, or a bit set on a kept or non-eligible block.
        """
        words = self.words[self.offsets[segment] : self.offsets[segment + 1]]
        eligible = span.num_correctable_blocks
        if len(words) != cdiv(eligible, CORRECTION_CHUNK):
            raise ValueError(
                f"todo_masks: segment {segment} has {len(words)} words, its eligible range of {eligible} blocks "
                f"needs {cdiv(eligible, CORRECTION_CHUNK)}"
            )
        todo = []
        for w, word in enumerate(words):
            # Words are signed int64; Python shifts ints as infinite two's complement, so a
            # negative word (bit 63 set) yields the same low 64 bits as its unsigned value.
            todo.extend(w * CORRECTION_CHUNK + bit for bit in range(CORRECTION_CHUNK) if word >> bit & 1)
        kept_set = set(kept)
        bad = [j for j in todo if j >= eligible or j in kept_set]
        if bad:
            raise ValueError(
                f"todo_masks: segment {segment} marks block {bad[0]} as todo, but todo blocks must be eligible "
                f"(< {eligible}) and not kept"
            )
        return todo


def _check_plan(plan: CorrectionPlan, index: BlockIndex, batch: PagedPrefillBatch, shapes: PrefillShapes) -> None:
    """Check that a correction plan fits the index and the batch (host sync)."""
    if not isinstance(plan, CorrectionPlan):
        raise TypeError(f"plan must be a CorrectionPlan or None; got {type(plan).__name__}")
    stats = plan.statistics
    if stats.block_size != index.block_size:
        raise ValueError(
            f"plan statistics use block_size={stats.block_size}, the block index block_size={index.block_size}"
        )
    if stats.num_kv_heads != shapes.num_kv_heads or stats.head_dim != shapes.head_dim:
        raise ValueError(
            f"plan statistics have pooled_k shape {tuple(stats.pooled_k.shape)}; expected (*, "
            f"{shapes.num_kv_heads}, {shapes.head_dim}) for the cache"
        )
    block_offsets = stats.block_offsets.cpu().tolist()
    expected = [num_key_blocks(k, index.block_size) for k in batch.host.seqlens_k]
    counts = [b - a for a, b in itertools.pairwise(block_offsets)]
    if counts != expected:
        raise ValueError(
            f"plan statistics hold {counts[:8]} blocks per request (block_offsets), the batch needs {expected[:8]}"
        )
    if plan.todo_offsets is not None and plan.todo_offsets.numel() != index.num_segments + 1:
        raise ValueError(
            f"todo_offsets must have num_segments + 1 = {index.num_segments + 1} entries; got shape "
            f"{tuple(plan.todo_offsets.shape)}"
        )
    if plan.todo_offsets is not None and int(plan.todo_offsets[-1]) != plan.todo_masks.numel():
        raise ValueError(
            f"todo_offsets[-1]={int(plan.todo_offsets[-1])} must equal the number of words, todo_masks has "
            f"shape {tuple(plan.todo_masks.shape)}"
        )
