"""Shared test setup of fpv2-kernel: GPU markers, the ``device`` fixture and independent oracles.

The oracles here are deliberately written without the reference helpers
(no ``gather_kv``, ``tile_span``, ``pack_queries``, ``todo_blocks``): each
builds its answer from contiguous per-request tensors and plain loops, so a
bug in a shared helper cannot hide in both the code and its test.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fpv2.kernel import BlockIndex, PagedPrefillBatch

#: The public header's include root in this source tree (``fpv2/fpv2.h`` below it).
HEADER_INCLUDE_DIR = Path(__file__).resolve().parents[1] / "include"

#: Compilers and their strict flags for programs that include the public header.
C_COMPILERS: dict[str, list[str]] = {
    "cc": ["-std=c99", "-pedantic", "-Wall", "-Werror"],
    "c++": ["-x", "c++", "-std=c++17", "-Wall"],
}


@pytest.fixture
def run_against_header(tmp_path: Path) -> Callable[[str, str], str]:
    """``run(source, compiler="cc")``: compile a program against the in-tree ``fpv2.h`` and return its stdout.

    The compiler must be on PATH (callers skip otherwise); a failed compile or a non-zero exit raises.
    """

    def run(source: str, compiler: str = "cc") -> str:
        stem = f"program_{compiler.replace('+', 'p')}"
        path = tmp_path / f"{stem}.c"
        path.write_text(source)
        exe = tmp_path / stem
        command = [compiler, *C_COMPILERS[compiler], f"-I{HEADER_INCLUDE_DIR}", str(path), "-o", str(exe)]
        subprocess.run(command, check=True)
        return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout

    return run


# --------------------------------------------------------------------------- markers
def pytest_configure(config: pytest.Config) -> None:
    """Register the markers (also declared in pyproject.toml) and pin the CPU thread count.

    The CPU tests run many tiny tensor ops; on a small shared machine a multi-threaded
    pool makes each of them 10-50x slower than one thread. ``FPV2_TEST_THREADS``
    overrides the default of 1.
    """
    torch.set_num_threads(int(os.environ.get("FPV2_TEST_THREADS", "1")))
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "hopper: needs an sm_90 GPU and the native Hopper kernel")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests without CUDA, and ``hopper`` tests without an sm_90 device."""
    has_cuda = torch.cuda.is_available()
    is_hopper = has_cuda and torch.cuda.get_device_capability() == (9, 0)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_hopper = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "hopper" in item.keywords and not is_hopper:
            item.add_marker(skip_hopper)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The CUDA device when there is one, else the CPU (session-scoped, so hypothesis tests may use it)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------- inputs
@dataclass(frozen=True, eq=False)
class PagedCase:
    """A paged prefill call together with the contiguous tensors it was scattered from."""

    q: torch.Tensor  # (total_q, Hq, d)
    k_cache: torch.Tensor  # (num_pages, page_size, Hkv, d), unused slots hold NaN
    v_cache: torch.Tensor
    batch: PagedPrefillBatch
    keys: list[torch.Tensor]  # per request, (kv_len, Hkv, d): the ground truth, float32
    values: list[torch.Tensor]
    seqlens_q: list[int]
    seqlens_k: list[int]
    num_kv_heads: int

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.num_kv_heads

    @property
    def prefix(self) -> list[int]:
        return [k - q for q, k in zip(self.seqlens_q, self.seqlens_k)]

    @property
    def starts(self) -> list[int]:
        out = [0]
        for n in self.seqlens_q:
            out.append(out[-1] + n)
        return out


def make_case(
    seqlens_q: list[int],
    seqlens_k: list[int],
    *,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    constant_blocks: int | None = None,
    q_gain: float = 2.0,
    fill: float = math.nan,
    key_block_gains: Sequence[float] | None = None,
) -> PagedCase:
    """Random Q/K/V scattered into a cache through a random page permutation.

    Spare pages and the unused tail slots of each request's last page hold
    ``fill`` (NaN), so any read outside the page table shows up in the output.

    Args:
        constant_blocks: when set, K and V are constant within every run of this
            many tokens of each request (the mean correction is then exact).
        q_gain: multiplies the queries, sharpening the attention a little.
        key_block_gains: when set, each request's keys of 128-token block ``j`` are
            multiplied by ``key_block_gains[j % len(key_block_gains)]``, so that
            the rows' score maxima jump from one block to the next.
        fill: value of the cache slots no request owns (NaN by default).
    """
    gen = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for kv_len in seqlens_k:
        if constant_blocks:
            nblocks = -(-kv_len // constant_blocks)
            k = torch.randn(nblocks, num_kv_heads, head_dim, generator=gen).repeat_interleave(constant_blocks, 0)
            v = torch.randn(nblocks, num_kv_heads, head_dim, generator=gen).repeat_interleave(constant_blocks, 0)
            k, v = k[:kv_len], v[:kv_len]
        else:
            k = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen)
            v = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen)
        if key_block_gains:
            gains = torch.tensor(key_block_gains, dtype=k.dtype)
            k = k * gains[(torch.arange(kv_len) // 128) % len(gains)].view(-1, 1, 1)
        # Round through the input dtype so the ground truth is exactly what the cache holds.
        keys.append(k.to(dtype).float())
        values.append(v.to(dtype).float())
    q = (q_gain * torch.randn(sum(seqlens_q), num_q_heads, head_dim, generator=gen)).to(dtype)

    pages_per_request = [-(-n // page_size) for n in seqlens_k]
    num_pages = sum(pages_per_request) + 2  # two spare pages nobody owns
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(seqlens_k), max(max(pages_per_request), 1)), -1, dtype=torch.int32)
    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), fill)
    v_cache = torch.full_like(k_cache, fill)
    next_page = 0
    for b, (kv_len, n_pages) in enumerate(zip(seqlens_k, pages_per_request)):
        table[b, :n_pages] = perm[next_page : next_page + n_pages].to(torch.int32)
        next_page += n_pages
        token = torch.arange(kv_len)
        pages, slots = table[b].long()[token // page_size], token % page_size
        k_cache[pages, slots] = keys[b]
        v_cache[pages, slots] = values[b]
    cu = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    batch = PagedPrefillBatch(cu, torch.tensor(seqlens_k, dtype=torch.int32), table, page_size, num_pages)
    return PagedCase(
        q=q.to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        batch=batch.to(device),
        keys=keys,
        values=values,
        seqlens_q=list(seqlens_q),
        seqlens_k=list(seqlens_k),
        num_kv_heads=num_kv_heads,
    )


# --------------------------------------------------------------------------- oracle
MaskFn = Callable[[int, int], torch.Tensor]
ExtraFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def naive_attention(
    case: PagedCase,
    *,
    scale: float | None = None,
    allowed: MaskFn | None = None,
    extra: ExtraFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 attention, one (request, query head) at a time, from the contiguous K/V.

    Args:
        allowed: ``(b, hq) -> (q_len, kv_len) bool`` extra token mask, AND-ed with causal.
        extra: ``(b, hq) -> (logits (q_len, n), values (n, d))`` additional columns
            (``-inf`` logits where a row must not see one).

    Returns:
        ``out (total_q, Hq, d)`` and ``lse (total_q, Hq)``, float64 on the CPU. Rows
        without any visible column are 0 with lse ``-inf``.
    """
    q = case.q.double().cpu()
    hq_count, d = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(q.shape[0], hq_count, d, dtype=torch.float64)
    lse = torch.full((q.shape[0], hq_count), -math.inf, dtype=torch.float64)
    for b, (q_len, kv_len, prefix, start) in enumerate(zip(case.seqlens_q, case.seqlens_k, case.prefix, case.starts)):
        if q_len == 0:
            continue
        for hq in range(hq_count):
            h = hq // case.group
            k = case.keys[b][:, h].double()
            v = case.values[b][:, h].double()
            logits = q[start : start + q_len, hq] @ k.T * scale
            # Bottom-right causal: query i sits at absolute position prefix + i and sees keys 0 .. prefix + i.
            causal = torch.arange(kv_len)[None, :] <= prefix + torch.arange(q_len)[:, None]
            mask = causal if allowed is None else causal & allowed(b, hq)
            logits = logits.masked_fill(~mask, -math.inf)
            if extra is not None:
                extra_logits, extra_values = extra(b, hq)
                logits = torch.cat([logits, extra_logits.double()], dim=1)
                v = torch.cat([v, extra_values.double()], dim=0)
            row_lse = torch.logsumexp(logits, dim=1)
            finite = torch.isfinite(row_lse)
            weights = torch.where(finite[:, None], torch.exp(logits - row_lse[:, None]), torch.zeros_like(logits))
            out[start : start + q_len, hq] = weights @ v
            lse[start : start + q_len, hq] = row_lse
    return out, lse


# --------------------------------------------------------------------------- indexes
@dataclass(frozen=True)
class Segment:
    """One (request, KV head, tile) of a hand-built index, with its geometry computed in the test."""

    request: int
    kv_head: int
    tile: int
    row_begin: int
    row_end: int
    p_first: int
    p_last: int
    prefix: int
    block_size: int
    kept: tuple[int, ...]

    @property
    def diagonal_band(self) -> range:
        """Blocks from the first row's block to the last row's block (always kept by selection)."""
        first = (self.prefix + self.p_first) // self.block_size
        return range(first, (self.prefix + self.p_last) // self.block_size + 1)

    @property
    def num_eligible(self) -> int:
        """Blocks wholly before the first row's position: the correction's eligible range."""
        return (self.prefix + self.p_first) // self.block_size


KeepFn = Callable[[Segment], list[int]]


def build_index(
    batch: PagedPrefillBatch,
    *,
    num_kv_heads: int,
    group: int,
    tile_size: int,
    block_size: int,
    keep: KeepFn | None = None,
) -> tuple[BlockIndex, list[Segment]]:
    """A CSR index written with plain loops (no fpv2.index, no geometry helpers).

    Args:
        batch: the batch to index.
        num_kv_heads: ``Hkv``.
        group: GQA group the rows are packed with.
        tile_size: packed rows per tile.
        block_size: tokens per key block.
        keep: ``segment -> kept ids``, called with the segment whose ``kept`` holds every
            causally visible block; all of them are kept by default.

    Returns:
        The index (on the batch's device) and its segments in segment order (request, KV head, tile).
    """
    host = batch.host
    offsets, blocks, tile_counts, segments = [0], [], [], []
    for b, (q_len, prefix) in enumerate(zip(host.q_lens, host.prefix)):
        ntiles = (q_len * group + tile_size - 1) // tile_size
        tile_counts.append(ntiles)
        for h in range(num_kv_heads):
            for t in range(ntiles):
                row_begin, row_end = t * tile_size, min((t + 1) * tile_size, q_len * group)
                p_first, p_last = row_begin // group, (row_end - 1) // group
                visible = tuple(range((prefix + p_last) // block_size + 1))
                seg = Segment(b, h, t, row_begin, row_end, p_first, p_last, prefix, block_size, visible)
                if keep is not None:
                    seg = dataclasses.replace(seg, kept=tuple(sorted(set(keep(seg)))))
                blocks.extend(seg.kept)
                offsets.append(len(blocks))
                segments.append(seg)
    tile_offsets = [0]
    for n in tile_counts:
        tile_offsets.append(tile_offsets[-1] + n)
    device = batch.device
    index = BlockIndex(
        torch.tensor(offsets, dtype=torch.int32, device=device),
        torch.tensor(blocks, dtype=torch.int32, device=device),
        torch.tensor(tile_offsets, dtype=torch.int32, device=device),
        num_kv_heads=num_kv_heads,
        group=group,
        tile_size=tile_size,
        block_size=block_size,
    )
    return index, segments


def token_masks(case: PagedCase, segments: list[Segment], block_size: int) -> MaskFn:
    """``(b, hq) -> (q_len, kv_len)`` kept-token masks of an index, built from its segments (no causal)."""
    masks: dict[tuple[int, int], torch.Tensor] = {}
    g = case.group
    for seg in segments:
        kv_len = case.seqlens_k[seg.request]
        token_kept = torch.zeros(kv_len, dtype=torch.bool)
        for j in seg.kept:
            token_kept[j * block_size : (j + 1) * block_size] = True
        for r in range(seg.row_begin, seg.row_end):
            hq = seg.kv_head * g + r % g
            key = (seg.request, hq)
            if key not in masks:
                masks[key] = torch.zeros(case.seqlens_q[seg.request], kv_len, dtype=torch.bool)
            masks[key][r // g] = token_kept
    return lambda b, hq: masks[(b, hq)]


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def paged_case() -> Callable[..., PagedCase]:
    """Factory of :class:`PagedCase` (see :func:`make_case`)."""
    return make_case


@pytest.fixture(scope="session")
def oracle() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The independent fp64 attention (see :func:`naive_attention`)."""
    return naive_attention


@pytest.fixture(scope="session")
def hand_index() -> Callable[..., tuple[BlockIndex, list[Segment]]]:
    """Builder of plain-loop CSR indexes (see :func:`build_index`)."""
    return build_index


@pytest.fixture(scope="session")
def index_token_masks() -> Callable[[PagedCase, list[Segment], int], MaskFn]:
    """Token masks of a hand-built index (see :func:`token_masks`)."""
    return token_masks
