"""vLLM v1 batch metadata -> fpv2 metadata: the decode/prefill split and the paged prefill batch.

vLLM's model runner reorders a batch so that its decode requests come first
(those with at most ``reorder_batch_threshold`` new tokens), followed by the
prefill requests (plain prompts, chunks of chunked prefill, prompts on top of
a cached prefix). Its ``CommonAttentionMetadata`` then holds, per request ``b``:

* ``query_start_loc[b]`` -- the first row of request ``b`` in the packed query
  (``(num_reqs + 1,) int32``, with a CPU copy ``query_start_loc_cpu``);
* ``seq_lens[b]`` -- KV tokens after this step, prefix included;
* ``block_table_tensor[b, j]`` -- the KV cache block holding tokens
  ``j * block_size .. (j + 1) * block_size - 1`` of the request.

That is exactly fpv2's :class:`~fpv2.kernel.PagedPrefillBatch` (page table,
``seqlens_k``, query offsets, page size) once the decode requests are cut
off: the prefill requests' offsets are shifted by the decode token count and
page size = vLLM's (kernel) block size. The cache itself is read as it is
(see :mod:`.vllm_kv_cache`).

This module does not import vLLM: it works on tensors shaped like vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.contracts import HostBatchView


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_index_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    """An integer tensor of rank ``ndim`` (vLLM keeps its index arrays in int32, slot maps in int64)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64; got {_describe(t)}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have rank {ndim}; got {_describe(t)}")
    return t


@dataclass(frozen=True)
class BatchSplit:
    """Where a reordered vLLM batch switches from decode to prefill requests.

    Requests ``0 .. num_decodes - 1`` (query rows ``0 .. num_decode_tokens - 1``)
    are decodes; the remaining ``num_prefills`` requests (the next
    ``num_prefill_tokens`` rows) are prefills.

    Attributes:
        num_decodes: decode requests at the front of the batch.
        num_decode_tokens: their query rows.
        num_prefills: prefill requests after them.
        num_prefill_tokens: their query rows (padding rows excluded).
    """

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int

    @property
    def num_reqs(self) -> int:
        """All requests of the batch."""
        return self.num_decodes + self.num_prefills


def split_decode_prefill(query_start_loc_cpu: torch.Tensor, decode_threshold: int = 1) -> BatchSplit:
    """Split a reordered vLLM batch into its leading decodes and the prefills after them.

    Same rule as vLLM's ``split_decodes_and_prefills`` (short extends counted as
    decodes, no uniformity requirement): the first request with more than
    ``decode_threshold`` query tokens and every request after it are prefills.

    Args:
        query_start_loc_cpu: ``(num_reqs + 1,)`` int32/int64 CPU query offsets.
        decode_threshold: the longest query still treated as a decode (vLLM's
            ``reorder_batch_threshold``).

    Returns:
        The :class:`BatchSplit`.

    Raises:
        TypeError: ``query_start_loc_cpu`` is not an integer tensor or
            ``decode_threshold`` not an int.
        ValueError: it is not on the CPU, not rank 1 or has fewer than 2 entries,
            or ``decode_threshold < 1``.
    """
    qsl = _check_index_tensor("query_start_loc_cpu", query_start_loc_cpu, 1)
    if qsl.device.type != "cpu":
        raise ValueError(f"query_start_loc_cpu must be the CPU copy of query_start_loc; got {_describe(qsl)}")
    if qsl.numel() < 2:
        raise ValueError(f"query_start_loc_cpu must hold num_reqs + 1 >= 2 offsets; got {_describe(qsl)}")
    if isinstance(decode_threshold, bool) or not isinstance(decode_threshold, int):
        raise TypeError(f"decode_threshold must be an int; got {type(decode_threshold).__name__}")
    if decode_threshold < 1:
        raise ValueError(f"decode_threshold must be >= 1; got {decode_threshold}")
    offsets = qsl.tolist()
    num_reqs = len(offsets) - 1
    first_prefill = next((b for b in range(num_reqs) if offsets[b + 1] - offsets[b] > decode_threshold), num_reqs)
    return BatchSplit(
        num_decodes=first_prefill,
        num_decode_tokens=offsets[first_prefill] - offsets[0],
        num_prefills=num_reqs - first_prefill,
        num_prefill_tokens=offsets[-1] - offsets[first_prefill],
    )


def prefill_batch_from_vllm(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    first_prefill: int,
    page_size: int,
    num_pages: int,
    host: HostBatchView | None = None,
    check_values: bool = False,
) -> PagedPrefillBatch:
    """The prefill requests ``first_prefill ..`` of a vLLM batch as a :class:`PagedPrefillBatch`.

    No data moves: the page table is vLLM's block table (its rows from
    ``first_prefill`` on), ``seqlens_k`` are vLLM's ``seq_lens`` and the query
    offsets are vLLM's shifted to start at 0. Nothing is read on the host unless
    ``host`` is missing or ``check_values`` is set.

    Args:
        query_start_loc: ``(num_reqs + 1,)`` int32 query offsets of the whole batch (device).
        seq_lens: ``(num_reqs,)`` int32 KV lengths after this step, prefix included.
        block_table: ``(num_reqs, max_blocks)`` int32 KV cache block ids.
        first_prefill: index of the first prefill request (the decode count).
        page_size: tokens per KV cache block (vLLM's kernel block size).
        num_pages: blocks in the KV cache (the bound for block ids).
        host: the prefill requests' offsets (starting at 0) and KV lengths as host
            lists, e.g. from vLLM's CPU copies; with it, lengths are checked and
            the batch's host view is filled without a device sync.
        check_values: also validate every value on the device arrays (page ids
            included; a host sync).

    Returns:
        The batch of the prefill requests.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: shapes disagree, ``first_prefill`` leaves no request, or
            (with ``host`` / ``check_values``) a length or block id is invalid;
            the message names the argument.
    """
    qsl = _check_index_tensor("query_start_loc", query_start_loc, 1)
    lens = _check_index_tensor("seq_lens", seq_lens, 1)
    table = _check_index_tensor("block_table", block_table, 2)
    num_reqs = lens.shape[0]
    if qsl.shape[0] != num_reqs + 1:
        raise ValueError(
            f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries for seq_lens {_describe(lens)}; "
            f"got {_describe(qsl)}"
        )
    if table.shape[0] < num_reqs:
        raise ValueError(f"block_table must have at least num_reqs = {num_reqs} rows; got {_describe(table)}")
    if isinstance(first_prefill, bool) or not isinstance(first_prefill, int):
        raise TypeError(f"first_prefill must be an int; got {type(first_prefill).__name__}")
    if not 0 <= first_prefill < num_reqs:
        raise ValueError(f"first_prefill must lie in [0, {num_reqs}) to leave a prefill request; got {first_prefill}")
    qsl_p = qsl[first_prefill:]
    # Offsets relative to the first prefill row: the prefill queries are sliced from that row on.
    cu_seqlens_q = (qsl_p - qsl_p[:1]).to(torch.int32)
    seqlens_k = lens[first_prefill:].to(torch.int32).contiguous()
    page_table = table[first_prefill:num_reqs]
    if page_table.dtype != torch.int32:
        page_table = page_table.to(torch.int32)
    if host is not None:
        _check_host_lengths(host, num_reqs - first_prefill, page_size, page_table.shape[1])
    batch = PagedPrefillBatch(
        cu_seqlens_q=cu_seqlens_q,
        seqlens_k=seqlens_k,
        page_table=page_table,
        page_size=page_size,
        num_pages=num_pages,
        check_values=check_values,
    )
    if host is not None:
        # Seed the cached host view from vLLM's CPU copies: the pipeline reads the
        # lengths on the host, and this spares every layer of the step that sync.
        batch.assume_host_view(host)
    return batch


def _check_host_lengths(host: HostBatchView, num_prefills: int, page_size: int, max_blocks: int) -> None:
    """Check the prefill requests' host lengths against the block table width (no device sync)."""
    if len(host.cu_seqlens_q) != num_prefills + 1 or len(host.seqlens_k) != num_prefills:
        raise ValueError(
            f"host view must describe the {num_prefills} prefill requests; got {len(host.cu_seqlens_q)} offsets "
            f"and {len(host.seqlens_k)} lengths"
        )
    if host.cu_seqlens_q[0] != 0:
        raise ValueError(f"host cu_seqlens_q must start at 0; got {host.cu_seqlens_q[:4]}")
    for b, (q_len, kv_len) in enumerate(zip(host.q_lens, host.seqlens_k)):
        if q_len < 0 or kv_len < q_len:
            raise ValueError(
                f"prefill request {b} has {q_len} new tokens but seq_lens={kv_len}; vLLM's seq_lens must count "
                "the cached prefix plus the new tokens"
            )
        if -(-kv_len // page_size) > max_blocks:
            raise ValueError(
                f"block_table too narrow: prefill request {b} needs {-(-kv_len // page_size)} blocks for "
                f"seq_lens={kv_len} at block size {page_size}, the table has {max_blocks} columns"
            )


@dataclass(eq=False)
class VllmPrefillPart:
    """The prefill requests of one vLLM step, turned into a batch once per cache geometry.

    Every attention layer of a KV cache group shares one metadata object, so the
    :class:`PagedPrefillBatch` is built at the first layer (when the cache, and
    with it the number of blocks, is known) and reused by the others.

    Attributes:
        query_start_loc: the whole batch's ``(num_reqs + 1,)`` query offsets (device).
        seq_lens: the whole batch's ``(num_reqs,)`` KV lengths (device).
        block_table: the whole batch's ``(num_reqs, max_blocks)`` block table (device).
        first_prefill: index of the first prefill request.
        host: the prefill requests' host offsets and lengths, or None.
        check_values: validate block ids on the device (host sync).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    first_prefill: int
    host: HostBatchView | None = None
    check_values: bool = False
    _batches: dict[tuple[int, int], PagedPrefillBatch] = field(default_factory=dict, repr=False)

    def batch(self, *, num_pages: int, page_size: int) -> PagedPrefillBatch:
        """The :class:`PagedPrefillBatch` over a cache of ``num_pages`` blocks of ``page_size`` tokens.

        Args:
            num_pages: blocks in the layer's KV cache.
            page_size: tokens per block.

        Returns:
            The batch (built on first use, then cached).

        Raises:
            ValueError, TypeError: see :func:`prefill_batch_from_vllm`.
        """
        key = (num_pages, page_size)
        if key not in self._batches:
            self._batches[key] = prefill_batch_from_vllm(
                self.query_start_loc,
                self.seq_lens,
                self.block_table,
                first_prefill=self.first_prefill,
                page_size=page_size,
                num_pages=num_pages,
                host=self.host,
                check_values=self.check_values,
            )
        return self._batches[key]


def host_view_from_vllm(
    query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor | None, first_prefill: int
) -> HostBatchView | None:
    """Host offsets and KV lengths of the prefill requests from vLLM's CPU copies.

    Args:
        query_start_loc_cpu: ``(num_reqs + 1,)`` CPU query offsets.
        seq_lens_cpu: ``(num_reqs,)`` CPU KV lengths (vLLM's ``seq_lens_cpu_upper_bound``,
            exact for prefill rows), or None when vLLM did not provide them.
        first_prefill: index of the first prefill request.

    Returns:
        The host view, or None without ``seq_lens_cpu``.

    Raises:
        ValueError: the two disagree in length or ``seq_lens_cpu`` is not on the CPU.
    """
    if seq_lens_cpu is None:
        return None
    _check_index_tensor("seq_lens_cpu", seq_lens_cpu, 1)
    if seq_lens_cpu.device.type != "cpu":
        raise ValueError(f"seq_lens_cpu must be a CPU tensor; got {_describe(seq_lens_cpu)}")
    if seq_lens_cpu.shape[0] + 1 != query_start_loc_cpu.shape[0]:
        raise ValueError(
            f"seq_lens_cpu {_describe(seq_lens_cpu)} and query_start_loc_cpu {_describe(query_start_loc_cpu)} "
            "describe different numbers of requests"
        )
    offsets = query_start_loc_cpu[first_prefill:].tolist()
    return HostBatchView(
        cu_seqlens_q=[o - offsets[0] for o in offsets], seqlens_k=seq_lens_cpu[first_prefill:].tolist()
    )


@dataclass(eq=False)
class Fpv2VllmMetadata:
    """Per-step attention metadata of the fpv2 vLLM backend, shared by the layers of a KV cache group.

    Attributes:
        split: decode/prefill boundary of the batch.
        num_actual_tokens: query rows vLLM counts for this step (may include padding).
        slot_mapping: ``(num_actual_tokens,)`` KV cache slot per new token.
        prefill: the prefill requests, or None when there are none.
        decode: the decode backend's own metadata for the decode requests, or None.
    """

    split: BatchSplit
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    prefill: VllmPrefillPart | None = None
    decode: Any = None
