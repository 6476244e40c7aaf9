"""The paged prefill batch: which queries and which KV cache pages each request owns."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass
from functools import cached_property

import torch

from ._checks import check_contiguous, check_positive_int, check_shape, check_tensor, describe, first_bad

INDEX_DTYPES = (torch.int32,)


@dataclass(frozen=True, eq=False)
class PagedPrefillBatch:
    """Metadata of a varlen prefill batch over a paged KV cache.

    Request ``b`` owns queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of the packed
    query tensor and ``seqlens_k[b]`` keys (its cached prefix included), stored
    token ``i`` at ``(page_table[b, i // page_size], i % page_size)`` of the cache.
    Causal alignment is bottom-right: query ``i`` sits at absolute position
    ``prefix[b] + i`` with ``prefix = seqlens_k - q_lens``.

    Args:
        cu_seqlens_q: ``(B+1,) int32`` query offsets, starting at 0, non-decreasing.
        seqlens_k: ``(B,) int32`` KV lengths, prefix included, each ``>= q_len``.
        page_table: ``(B, max_pages) int32`` page ids; entries past a request's
            last page are ignored (any value, e.g. -1).
        page_size: tokens per page (1, 16, 64, 128, ...).
        num_pages: pages in the KV cache, the upper bound for page ids.
        check_values: also check the index values (offsets, lengths, page ids).
            That reads them on the host (a device sync); pass False on a hot path
            whose metadata was validated before.

    Raises:
        TypeError: an argument has the wrong type or dtype.
        ValueError: a shape, device, stride or value is inconsistent; the message
            names the argument and what was found.
    """

    cu_seqlens_q: torch.Tensor
    seqlens_k: torch.Tensor
    page_table: torch.Tensor
    page_size: int
    num_pages: int
    check_values: InitVar[bool] = True

    def __post_init__(self, check_values: bool) -> None:
        check_positive_int("page_size", self.page_size)
        check_positive_int("num_pages", self.num_pages)
        cu = check_tensor("cu_seqlens_q", self.cu_seqlens_q, dtypes=INDEX_DTYPES, ndim=1)
        device = cu.device
        if cu.numel() < 2:
            raise ValueError(f"empty batch: cu_seqlens_q must hold B+1 >= 2 offsets; got {describe(cu)}")
        batch = cu.numel() - 1
        sk = check_tensor("seqlens_k", self.seqlens_k, dtypes=INDEX_DTYPES, ndim=1, device=device)
        check_shape("seqlens_k", sk, (batch,))
        pt = check_tensor("page_table", self.page_table, dtypes=INDEX_DTYPES, ndim=2, device=device)
        if pt.shape[0] != batch:
            raise ValueError(f"page_table must have shape ({batch}, max_pages); got {describe(pt)}")
        for name in ("cu_seqlens_q", "seqlens_k"):
            check_contiguous(name, getattr(self, name))
        if pt.numel() > 0 and pt.stride(1) != 1:
            raise ValueError(
                f"page_table rows must be contiguous (stride 1 along pages); got strides {tuple(pt.stride())}"
            )
        if check_values:
            self.validate_values()

    # ------------------------------------------------------------------ values
    def validate_values(self) -> None:
        """Check offsets, lengths and page ids (host sync). Raises ``ValueError``."""
        cu = self.cu_seqlens_q.cpu().long()
        sk = self.seqlens_k.cpu().long()
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens_q[0] must be 0; got {int(cu[0])}")
        q_lens = cu[1:] - cu[:-1]
        if (q_lens < 0).any():
            b = first_bad(q_lens < 0)
            raise ValueError(
                f"cu_seqlens_q must be non-decreasing; request {b} has cu_seqlens_q[{b}]={int(cu[b])} > "
                f"cu_seqlens_q[{b + 1}]={int(cu[b + 1])}"
            )
        if (sk < q_lens).any():
            b = first_bad(sk < q_lens)
            raise ValueError(
                f"query longer than KV: request {b} has {int(q_lens[b])} queries but seqlens_k[{b}]="
                f"{int(sk[b])}; seqlens_k counts the whole KV (prefix + new tokens) and must be >= the query length"
            )
        pages_needed = (sk + self.page_size - 1) // self.page_size
        max_pages = self.page_table.shape[1]
        if (pages_needed > max_pages).any():
            b = first_bad(pages_needed > max_pages)
            raise ValueError(
                f"page_table too short: request {b} needs {int(pages_needed[b])} pages for seqlens_k={int(sk[b])} "
                f"at page_size={self.page_size}, but page_table has shape {tuple(self.page_table.shape)}"
            )
        pt = self.page_table.cpu().long()
        used = torch.arange(max_pages)[None, :] < pages_needed[:, None]
        bad = used & ((pt < 0) | (pt >= self.num_pages))
        if bad.any():
            b, j = (int(x) for x in torch.nonzero(bad)[0])
            raise ValueError(
                f"page id out of range: page_table[{b}, {j}]={int(pt[b, j])}, the cache has "
                f"num_pages={self.num_pages} (valid ids 0..{self.num_pages - 1})"
            )

    # ----------------------------------------------------------------- derived
    @property
    def num_requests(self) -> int:
        """Number of requests ``B``."""
        return self.cu_seqlens_q.numel() - 1

    @property
    def device(self) -> torch.device:
        """Device holding the index arrays."""
        return self.cu_seqlens_q.device

    @property
    def q_lens(self) -> torch.Tensor:
        """``(B,) int32`` query length per request (no sync)."""
        return (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).to(torch.int32)

    @property
    def prefix(self) -> torch.Tensor:
        """``(B,) int32`` cached prefix length per request, ``seqlens_k - q_lens`` (no sync)."""
        return (self.seqlens_k - self.q_lens).to(torch.int32)

    @cached_property
    def host(self) -> HostBatchView:
        """Host copies of the small index arrays, read once (one sync) and cached."""
        # Both arrays in one device-to-host copy: one synchronisation, not two.
        both = torch.cat([self.cu_seqlens_q, self.seqlens_k]).cpu().tolist()
        offsets = self.cu_seqlens_q.numel()
        return HostBatchView(cu_seqlens_q=both[:offsets], seqlens_k=both[offsets:])

    def assume_host_view(self, host: HostBatchView) -> PagedPrefillBatch:
        """Hand the batch host copies of its offsets and lengths that the caller already holds.

        Engines keep CPU copies of their sequence lengths; seeding the view spares
        the device read that :attr:`host` would otherwise make once per batch. The
        values are trusted, only their counts are checked: they must equal the
        device arrays (``check_values`` validates those).

        Args:
            host: the host lists, ``B+1`` query offsets and ``B`` KV lengths.

        Returns:
            ``self``, for chaining.

        Raises:
            ValueError: the lists do not have ``B+1`` and ``B`` entries.
        """
        if len(host.cu_seqlens_q) != self.num_requests + 1 or len(host.seqlens_k) != self.num_requests:
            raise ValueError(
                f"host view must hold {self.num_requests + 1} query offsets and {self.num_requests} KV lengths; "
                f"got {len(host.cu_seqlens_q)} and {len(host.seqlens_k)}"
            )
        # functools.cached_property stores its value in the instance dict (frozen dataclasses allow it).
        self.__dict__["host"] = host
        return self

    @property
    def total_q(self) -> int:
        """Total number of packed queries (host sync on first use)."""
        return self.host.cu_seqlens_q[-1]

    @property
    def max_seqlen_q(self) -> int:
        """Longest query length in the batch (host sync on first use)."""
        return max(self.host.q_lens, default=0)

    @property
    def max_seqlen_k(self) -> int:
        """Longest KV length in the batch (host sync on first use)."""
        return max(self.host.seqlens_k, default=0)

    def to(self, device: torch.device | str) -> PagedPrefillBatch:
        """The same batch with its index arrays on ``device`` (values not re-checked)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("cu_seqlens_q", "seqlens_k", "page_table"):
            moved[name] = moved[name].to(device)
        return PagedPrefillBatch(**moved, check_values=False)

    @classmethod
    def contiguous(
        cls,
        seqlens_q: list[int],
        seqlens_k: list[int],
        *,
        page_size: int = 1,
        device: torch.device | str = "cpu",
    ) -> PagedPrefillBatch:
        """A batch whose requests own consecutive pages (request ``b`` after ``b-1``).

        The matching cache holds ``sum(ceil(seqlens_k / page_size))`` pages; handy
        for tests and benchmarks. Lengths are validated like any other batch.
        """
        if len(seqlens_q) == 0:
            raise ValueError("empty batch: seqlens_q has no requests")
        if len(seqlens_q) != len(seqlens_k):
            raise ValueError(
                f"seqlens_q and seqlens_k must have one entry per request; got {len(seqlens_q)} and {len(seqlens_k)}"
            )
        pages = [-(-k // page_size) for k in seqlens_k]
        max_pages = max(max(pages), 1)
        table = torch.full((len(pages), max_pages), -1, dtype=torch.int32)
        start = 0
        for b, n in enumerate(pages):
            table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        cu = torch.zeros(len(seqlens_q) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(seqlens_q, dtype=torch.int32).cumsum(0)
        return cls(
            cu_seqlens_q=cu.to(device),
            seqlens_k=torch.tensor(seqlens_k, dtype=torch.int32, device=device),
            page_table=table.to(device),
            page_size=page_size,
            num_pages=max(start, 1),
        )


@dataclass(frozen=True)
class HostBatchView:
    """Host-side lists of a batch's offsets and lengths (for loops in references and planning)."""

    cu_seqlens_q: list[int]
    seqlens_k: list[int]

    @property
    def q_lens(self) -> list[int]:
        """Query length per request."""
        return [b - a for a, b in zip(self.cu_seqlens_q[:-1], self.cu_seqlens_q[1:])]

    @property
    def prefix(self) -> list[int]:
        """Cached prefix length per request."""
        return [k - q for k, q in zip(self.seqlens_k, self.q_lens)]
