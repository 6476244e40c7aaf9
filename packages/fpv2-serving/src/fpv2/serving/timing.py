"""Stage timing: CUDA events on a GPU, ``perf_counter`` on the CPU.

A :class:`StageClock` records a mark at each stage boundary. On CUDA the marks
are events on the stream that was current when the clock was made, so recording
them costs no synchronisation; the elapsed times are read (one event sync) only
when :meth:`StageClock.timings` is first called.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
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
        device: the device the stages run on; CUDA devices use events on that
            device's stream current at construction (the stream the call runs on),
            any other device host ``perf_counter`` (the CPU path is synchronous).
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        # The device's current stream, looked up once: a mark records on it directly (no device context and
        # stream lookup per mark, ~30 us of host time each on the GPU machine). The stream belongs to
        # ``device`` even when another device is current, and recording needs no device switch: the event is
        # created on, and recorded under a guard of, its stream's device.
        self._stream = torch.cuda.current_stream(device) if self._cuda else None
        self._marks: dict[str, object] = {}
        self._resolved: StageTimings | None = None

    @property
    def uses_cuda_events(self) -> bool:
        """Whether marks are CUDA events (else host ``perf_counter`` readings)."""
        return self._cuda

    def mark(self, name: str) -> None:
        """Record the boundary ``name`` now (on a GPU: on the device's stream that was current at construction).

        Args:
            name: boundary label, e.g. ``"start"`` or a stage name ("end of stage").
        """
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self._stream)
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


def idle_host_us(fn: Callable[[], object], calls: int = 50) -> float:
    """Median host microseconds of ``fn`` started on an idle GPU (each call after ``torch.cuda.synchronize``).

    The host cost of issuing work, as a pipeline call pays it when nothing is queued ahead of it
    (the benchmarks' host probes).

    Args:
        fn: the call.
        calls: samples.

    Returns:
        The median, rounded to 0.1 us.
    """
    samples = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return round(median(samples), 1)


def timed_call(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Milliseconds of one call: CUDA events around it on a GPU, ``perf_counter`` on the (synchronous) CPU.

    Args:
        fn: the call.
        device: where it runs.

    Returns:
        ``(ms, result)``.
    """
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)), result
    t0 = time.perf_counter()
    result = fn()
    return (time.perf_counter() - t0) * 1e3, result


def timed_samples(
    fn: Callable[[], object],
    warmup: int,
    repeats: int,
    device: torch.device,
    *,
    on_call: Callable[[object, bool], None] | None = None,
) -> tuple[list[float], object]:
    """Warm up, then time ``repeats`` calls with :func:`timed_call`.

    Args:
        fn: the call.
        warmup: untimed calls first.
        repeats: timed calls.
        device: where it runs.
        on_call: called after every call, outside the timed region, with its result and
            whether it was timed (warm-up calls are not): progress bars, stage-time collection.

    Returns:
        ``(samples_ms, last result)``.
    """
    samples: list[float] = []
    result: object = None
    for i in range(warmup + repeats):
        result = None  # free the previous output before the next call allocates its own
        ms, result = timed_call(fn, device)
        if i >= warmup:
            samples.append(ms)
        if on_call is not None:
            on_call(result, i >= warmup)
    return samples, result


def warm_for(fn: Callable[[], object], ms: float, device: torch.device) -> int:
    """Call ``fn`` until ``ms`` milliseconds have passed (at least once), waiting for each call to finish.

    A time-based warm-up: a GPU's clock follows its power draw over about a second, so a few warm-up calls
    right after a heavier workload (``fpv2 bench``'s dense baselines hold an H200 at its power cap) can still
    run at that workload's clock. Warming each implementation up on its own calls for a while is meant to time
    it at its own steady clock instead (how much that changes a timing is not measured yet).

    Args:
        fn: the call.
        ms: wall milliseconds to keep calling (``<= 0``: one call).
        device: where it runs (CUDA: synchronised after every call).

    Returns:
        The number of calls made.
    """
    calls = 0
    start = time.perf_counter()
    while True:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        calls += 1
        if (time.perf_counter() - start) * 1e3 >= ms:
            return calls


#: Shortest GPU spin before a host-ahead call, in milliseconds (host issue of a pipeline call: 0.2-0.8 ms).
HOST_AHEAD_MIN_LEAD_MS = 2.0
#: Longest spin a host-ahead call may ask for before giving up (a call that waits on the GPU never gets ahead).
#: A dense 128K call issues in 6-18 ms without a sync (H200 probe, 2026-12-02): 64 ms gave up on its spikes.
HOST_AHEAD_MAX_LEAD_MS = 1000.0
#: Share of the spin the host may spend issuing the call: the rest is margin for the spin's own launch.
HOST_AHEAD_MARGIN = 0.8


def spin_cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured once with events on ``device``.

    Args:
        device: a CUDA device.

    Returns:
        Cycles per millisecond of the spin kernel at the clock the GPU runs now.
    """
    cycles = 2_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)  # first launch loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(float(start.elapsed_time(end)), 1e-3)


def next_spin_lead_ms(host_ms: float, lead_ms: float) -> float | None:
    """The spin to use after a host-ahead call: ``lead_ms`` when the host issued the call in time, else more.

    The host is ahead when it finished issuing the call (``host_ms``, from the spin's launch to the call's
    return) within :data:`HOST_AHEAD_MARGIN` of the spin: then every launch of the call was queued before the
    GPU reached it, and the events between the spin and the call's end time the GPU alone.

    Args:
        host_ms: host time from the spin's launch to the call's return.
        lead_ms: the spin that call used.

    Returns:
        ``lead_ms`` if the call counts, a longer lead (at least twice the host time) to redo it with, or
        None when even :data:`HOST_AHEAD_MAX_LEAD_MS` would not do (the call waits on the GPU: a host sync).
    """
    if host_ms <= HOST_AHEAD_MARGIN * lead_ms:
        return lead_ms
    wanted = max(2.0 * lead_ms, 2.0 * host_ms / HOST_AHEAD_MARGIN)
    return wanted if wanted <= HOST_AHEAD_MAX_LEAD_MS else None


def host_ahead_call(
    fn: Callable[[], object], device: torch.device, cycles_per_ms: float, lead_ms: float = HOST_AHEAD_MIN_LEAD_MS
) -> tuple[float | None, object, float]:
    """GPU milliseconds of one call with the host ahead of the GPU (as in a model's forward pass).

    A spin kernel holds the stream for ``lead_ms`` while the host issues the call behind it, so that the
    call's kernels run back to back; the call is redone with a longer spin until the host kept up
    (:func:`next_spin_lead_ms`). Events inside the call (a :class:`StageClock`) time its stages the same way.

    Args:
        fn: the call (issues work on the current stream of ``device``).
        device: a CUDA device.
        cycles_per_ms: :func:`spin_cycles_per_ms` of ``device``.
        lead_ms: the first spin to try.

    Returns:
        ``(ms or None, result, lead_ms)``: the GPU time (None when the host never got ahead: the call
        synchronises with the GPU), the call's result and the spin that worked (reuse it for the next call).
    """
    result: object = None
    lead: float | None = lead_ms
    while lead is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        result = None  # free the previous output before the next call allocates its own
        t0 = time.perf_counter()
        torch.cuda._sleep(int(lead * cycles_per_ms))
        start.record()
        result = fn()
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        wanted = next_spin_lead_ms(host_ms, lead)
        if wanted == lead:
            return float(start.elapsed_time(end)), result, lead
        lead = wanted
    return None, result, HOST_AHEAD_MIN_LEAD_MS


def host_ahead_samples(
    fn: Callable[[], object],
    repeats: int,
    device: torch.device,
    *,
    on_call: Callable[[object, bool], None] | None = None,
) -> tuple[list[float] | None, object]:
    """Time ``repeats`` calls with :func:`host_ahead_call` (after :func:`timed_samples` warmed ``fn`` up).

    Args:
        fn: the call.
        repeats: timed calls.
        device: a CUDA device.
        on_call: called after every call with its result and True (as in :func:`timed_samples`).

    Returns:
        ``(samples_ms or None, last result)``; None when some call never let the host get ahead.

    Raises:
        ValueError: ``device`` is not a CUDA device (the CPU path is synchronous: there is no "ahead").
    """
    if device.type != "cuda":
        raise ValueError(f"host-ahead timing needs a CUDA device, got {device}")
    cycles_per_ms = spin_cycles_per_ms(device)
    samples: list[float] = []
    lead, result = HOST_AHEAD_MIN_LEAD_MS, None
    for _ in range(repeats):
        result = None
        ms, result, lead = host_ahead_call(fn, device, cycles_per_ms, lead)
        if on_call is not None:
            on_call(result, True)
        if ms is None:
            return None, result
        samples.append(ms)
    return samples, result


def benchmark_device(name: str) -> torch.device:
    """The torch device a benchmark script runs on, with an explicit index for CUDA.

    Args:
        name: a torch device string (``cpu``, ``cuda``, ``cuda:1``).

    Returns:
        The device (made current for CUDA; torch 2.11 refuses ``set_device("cuda")`` without an index).

    Raises:
        RuntimeError: CUDA asked for but not available.
    """
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name} but no CUDA GPU here (use --device cpu for a dry run)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


#: Timed runs the benchmark protocol asks for on a GPU (BENCHMARKS.md).
MIN_GPU_REPEATS = 10


def protocol_notes(device: torch.device, repeats: int, dry_run: str) -> list[str]:
    """The notes every benchmark result carries about how far its run follows the protocol.

    Args:
        device: where the benchmark ran.
        repeats: its timed runs.
        dry_run: what a CPU run's numbers are (they are never benchmark numbers).

    Returns:
        ``["CPU dry run: ..."]`` on the CPU, a note on too few runs on a GPU, else ``[]``.
    """
    if device.type != "cuda":
        return [f"CPU dry run: {dry_run}"]
    if repeats < MIN_GPU_REPEATS:
        return [f"only {repeats} timed runs: the protocol asks for >= {MIN_GPU_REPEATS}"]
    return []
