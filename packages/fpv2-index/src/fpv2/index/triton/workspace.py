"""Scratch memory of the fused index stage, reused across calls and grown by capacity.

The fused selection kernel (:mod:`.scoring`) runs a *persistent* grid of ``P``
programs; each program walks many (request, KV head, tile) segments one after
the other and needs scratch only for the segment it is on. So the scratch does
not grow with ``Hkv * tiles * blocks`` (the published implementation's layout,
about 0.4 GB at 128K tokens with 32/8 heads) but with:

- energies: one fp32 row of ``Nb`` log2 block energies per tile a *program*
  scores at once (``T = tiles_per_program``, 1 or 2), ``P * T * Nb * 4`` bytes;
- keep bits: one bit per (segment, block), padded to whole chunks of
  :data:`CHUNK_BLOCKS` blocks, ``S * ceil(Nb / 64) * 8`` bytes;
- counts: one int32 per segment, ``S * 4`` bytes;

with ``Nb`` the largest number of key blocks of a request, ``S = Hkv * tiles``
the number of segments and ``P = min(S / T, programs per SM * SMs)`` (``S / T``
rounded up per request: the units of work). Besides these, a workspace holds
one int32 completion counter (zeroed once, when the workspace first reserves;
the selection kernel leaves it at 0 after every call), not counted in
:attr:`IndexWorkspace.nbytes`.

A call at the same shape as the one before gets the same view objects back:
no allocation and no new tensors. Only scratch lives here; the index stage's
outputs are fresh tensors on every call (:mod:`.outputs`), since callers keep
them across calls.

At 128K tokens, one request, 32 query / 8 KV heads, ``Bk = Mt = 128`` on an
H200 (132 SMs, 3 programs per SM by default, so ``P = 396``): ``Nb = 1024`` and
``S = 8 * 4096 = 32768``, i.e. 1.62 MB of energies, 4.19 MB of keep bits and
0.13 MB of counts: **5.9 MB in all** (see :meth:`IndexWorkspace.required_bytes`;
measured 5,947,392 bytes), about 70 times less than the published layout. With
two tiles per program (2 programs per SM, ``P = 264``) the energies are 2.16 MB.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import tuning

#: Pooled keys per step of the fused pass; also the granule of the keep bits (two int32 words).
CHUNK_BLOCKS = 64
#: Bits per keep-bit word (int32 words).
WORD_BITS = 32
#: Persistent programs per streaming multiprocessor on CUDA: :attr:`.tuning.ScoreTuning.programs_per_sm`.
#: Persistent programs under the Triton interpreter (it runs programs one by one anyway).
INTERPRETER_PROGRAMS = 8


def words_per_segment(max_blocks: int) -> int:
    """int32 keep-bit words per segment: ``ceil(max_blocks / 64)`` chunks of two words.

    Args:
        max_blocks: the largest number of key blocks of a request (``Nb``).

    Returns:
        Words per segment row of the keep bits (at least one chunk).
    """
    chunks = max(1, -(-max_blocks // CHUNK_BLOCKS))
    return chunks * (CHUNK_BLOCKS // WORD_BITS)


class WorkspaceViews(NamedTuple):
    """The slices of an :class:`IndexWorkspace` one call uses.

    Attributes:
        energies: ``(P * T, Nb) float32`` log2 block energies, rows ``T p .. T p + T - 1`` for the
            ``T`` tiles persistent program ``p`` scores at once.
        keep_bits: ``(S, W) int32`` keep bits, one row per segment (``W`` from :func:`words_per_segment`).
        counts: ``(S,) int32`` kept blocks per segment.
        done: ``(1,) int32`` completion counter of the selection kernel's programs (0 between calls).
    """

    energies: torch.Tensor
    keep_bits: torch.Tensor
    counts: torch.Tensor
    done: torch.Tensor


class IndexWorkspace:
    """Scratch buffers of the fused index stage, kept between calls and grown only when a call needs more.

    Use one workspace per CUDA stream (calls on one stream are ordered, so they
    may share it). The buffers never shrink; :attr:`nbytes` is therefore the
    largest :meth:`required_bytes` of the calls seen so far.

    Args:
        device: device of the buffers; ``None`` adopts the device of the first call.
        max_programs: cap on the persistent grid size ``P`` (``None``: the programs per SM of
            :mod:`.tuning` on CUDA; 8 under the Triton interpreter). Smaller means less scratch and
            less parallelism.

    Raises:
        TypeError: ``max_programs`` is not a positive int.
    """

    def __init__(self, device: torch.device | str | None = None, *, max_programs: int | None = None) -> None:
        if max_programs is not None and (
            isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1
        ):
            raise TypeError(f"max_programs must be a positive int or None, got {max_programs!r}")
        self.device = torch.device(device) if device is not None else None
        self.max_programs = max_programs
        self._energies: torch.Tensor | None = None
        self._keep_bits: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._done: torch.Tensor | None = None
        self._views: tuple[tuple[int, int, int, int], WorkspaceViews] | None = None  # the last call's, by shape

    @staticmethod
    def required_bytes(num_programs: int, max_blocks: int, num_segments: int, tiles_per_program: int = 1) -> int:
        """Bytes one call needs: ``P * T * Nb * 4 + S * W * 4 + S * 4``.

        Args:
            num_programs: persistent programs ``P``.
            max_blocks: largest number of key blocks of a request ``Nb``.
            num_segments: segments ``S = Hkv * tiles``.
            tiles_per_program: tiles ``T`` a program scores at once (one energies row each).

        Returns:
            The size in bytes (``W = ceil(Nb / 64) * 2`` int32 words per segment).
        """
        rows = num_programs * tiles_per_program
        return 4 * (rows * max(max_blocks, 1) + num_segments * words_per_segment(max_blocks) + num_segments)

    @property
    def nbytes(self) -> int:
        """Bytes currently held by the buffers."""
        return sum(
            t.numel() * t.element_size() for t in (self._energies, self._keep_bits, self._counts) if t is not None
        )

    def num_programs(self, num_work: int, device: torch.device, rows: int = 128, head_dim: int = 128) -> int:
        """Persistent grid size for ``num_work`` units of work on ``device``.

        Args:
            num_work: units of work (segments, or pairs of segments with two tiles per program).
            device: where the kernel runs.
            rows: scored rows per tile (fewer rows, fewer registers, more programs per SM).
            head_dim: ``d`` (larger heads, more shared memory, fewer programs per SM).

        Returns:
            ``min(num_work, cap)`` (at least 1), the cap from ``max_programs`` or the device.
        """
        if self.max_programs is not None:
            cap = self.max_programs
        elif device.type == "cuda":
            cap = tuning.SCORE.programs_for(rows, head_dim) * _sm_count(device)
        else:
            cap = INTERPRETER_PROGRAMS
        return max(1, min(num_work, cap))

    def reserve(
        self,
        *,
        num_programs: int,
        max_blocks: int,
        num_segments: int,
        device: torch.device,
        tiles_per_program: int = 1,
    ) -> WorkspaceViews:
        """Views sized for one call, growing the buffers when they are too small.

        Args:
            num_programs: persistent programs ``P``.
            max_blocks: largest number of key blocks of a request ``Nb``.
            num_segments: segments ``S``.
            device: device of the call.
            tiles_per_program: tiles a program scores at once; energies has ``P * tiles_per_program`` rows.

        Returns:
            The :class:`WorkspaceViews` of the call (contents undefined, the kernel writes before it reads,
            except ``done``, which reads 0).

        Raises:
            ValueError: the workspace lives on another device than the call.
        """
        device = torch.device(device)
        if self.device is None:
            self.device = device
        elif not _same_device(self.device, device):
            raise ValueError(f"IndexWorkspace lives on {self.device}, the call runs on {device}; use one per device")
        row = max(max_blocks, 1)
        num_rows = num_programs * tiles_per_program
        shape = (num_rows, row, num_segments, max_blocks)
        cached = self._views
        if cached is not None and cached[0] == shape:
            return cached[1]  # the buffers cannot have shrunk: same views, nothing new
        words = words_per_segment(max_blocks)
        self._energies = self._grow(self._energies, num_rows * row, torch.float32, device)
        self._keep_bits = self._grow(self._keep_bits, num_segments * words, torch.int32, device)
        self._counts = self._grow(self._counts, num_segments, torch.int32, device)
        if self._done is None:
            self._done = torch.zeros(1, dtype=torch.int32, device=device)
        views = WorkspaceViews(
            energies=self._energies[: num_rows * row].view(num_rows, row),
            keep_bits=self._keep_bits[: num_segments * words].view(num_segments, words),
            counts=self._counts[:num_segments],
            done=self._done,
        )
        self._views = (shape, views)
        return views

    def reset_counter(self) -> None:
        """Zero the completion counter again (after a selection kernel that did not finish, e.g. raised)."""
        if self._done is not None:
            self._done.zero_()

    @staticmethod
    def _grow(buf: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``buf`` if it holds ``numel`` elements, else a new buffer of exactly that capacity."""
        if buf is not None and buf.numel() >= numel:
            return buf
        return torch.empty(max(numel, 1), dtype=dtype, device=device)


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: this runs on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality that treats ``cuda`` and ``cuda:<current>`` as the same device."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
