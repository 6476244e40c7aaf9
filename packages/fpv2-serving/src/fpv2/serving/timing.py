"""Stage timing: CUDA events on a GPU, ``perf_counter`` on the CPU.

A :class:`StageClock` records a mark at each stage boundary. On CUDA the marks
are events on the current stream, so recording them costs no synchronisation;
the elapsed times are read (one event sync) only when :meth:`StageClock.timings`
is first called.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

#: The stages of one pipeline call, in order.
STAGES = ("index", "correction", "attention")


@dataclass(frozen=True)
class StageTimings:
    """Wall time of each pipeline stage of one call, in milliseconds.

    ``index_ms`` covers the pooled statistics (shared with the correction) and
    the selection; ``correction_ms`` the correction plan (the correction terms
    themselves run inside the attention kernel); ``attention_ms`` the kernel.
    """

    index_ms: float
    correction_ms: float
    attention_ms: float

    @property
    def total_ms(self) -> float:
        """Sum of the three stages."""
        return self.index_ms + self.correction_ms + self.attention_ms


class StageClock:
    """Marks stage boundaries on one device and turns them into :class:`StageTimings`.

    Args:
        device: the device the stages run on; CUDA devices use events, any
            other device host ``perf_counter`` (the CPU path is synchronous).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._marks: dict[str, object] = {}
        self._resolved: StageTimings | None = None

    @property
    def uses_cuda_events(self) -> bool:
        """Whether marks are CUDA events (else host ``perf_counter`` readings)."""
        return self._cuda

    def mark(self, name: str) -> None:
        """Record the boundary ``name`` now (on the current CUDA stream when on a GPU).

        Args:
            name: boundary label, e.g. ``"start"`` or a stage name ("end of stage").
        """
        if self._cuda:
            with torch.cuda.device(self._device):
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            self._marks[name] = event
        else:
            self._marks[name] = time.perf_counter()

    def elapsed_ms(self, begin: str, end: str) -> float:
        """Milliseconds between two recorded marks (synchronises on ``end`` for CUDA).

        Args:
            begin: label of the earlier mark.
            end: label of the later mark.

        Returns:
            The elapsed time in milliseconds.

        Raises:
            KeyError: a mark was never recorded.
        """
        a, b = self._marks[begin], self._marks[end]
        if self._cuda:
            b.synchronize()  # type: ignore[union-attr]
            return float(a.elapsed_time(b))  # type: ignore[union-attr]
        return (float(b) - float(a)) * 1e3  # type: ignore[arg-type]

    def timings(self) -> StageTimings:
        """The stage times of the marks ``start``, ``index``, ``correction``, ``attention`` (cached).

        Returns:
            The :class:`StageTimings` of the recorded call.
        """
        if self._resolved is None:
            bounds = ("start", *STAGES)
            ms = [self.elapsed_ms(a, b) for a, b in itertools.pairwise(bounds)]
            self._resolved = StageTimings(*ms)
        return self._resolved


def median(values: list[float]) -> float:
    """Median of a non-empty list (mean of the middle pair for even lengths).

    Args:
        values: the samples.

    Returns:
        The median.

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("median of an empty list")
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])
