"""StageClock: perf_counter marks on the CPU, events on the construction-time stream on CUDA (faked here)."""

from __future__ import annotations

import itertools

import pytest
import torch

from fpv2.serving import timing
from fpv2.serving.timing import StageClock

BOUNDS = ("start", "index", "correction", "attention")


def test_cpu_marks_read_perf_counter(monkeypatch):
    readings = iter([10.0, 10.5, 11.0, 13.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(readings))
    clock = StageClock(torch.device("cpu"))
    assert not clock.uses_cuda_events
    for name in BOUNDS:
        clock.mark(name)
    t = clock.timings()
    assert (t.index_ms, t.correction_ms, t.attention_ms) == (500.0, 500.0, 2000.0)
    assert clock.timings() is t  # resolved once
    with pytest.raises(KeyError):
        clock.elapsed_ms("start", "never")


def test_cpu_marks_without_fakes_are_ordered():
    clock = StageClock(torch.device("cpu"))
    for name in BOUNDS:
        clock.mark(name)
    t = clock.timings()
    assert min(t.index_ms, t.correction_ms, t.attention_ms) >= 0.0


class _FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: remembers the stream it was recorded on and a fake time."""

    ticks = itertools.count()

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.stream: object = "never recorded"
        self.time_ms = -1.0
        self.synchronized = False

    def record(self, stream: object = None) -> None:
        self.stream = stream
        self.time_ms = float(next(self.ticks))

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.time_ms - self.time_ms


def _no_device_context(*args, **kwargs):
    raise AssertionError("StageClock.mark must not enter a device context")


def test_cuda_marks_record_on_the_stream_current_at_construction(monkeypatch):
    construction, later = _FakeStream("construction"), _FakeStream("later")
    asked: list[object] = []
    current = [construction]

    def current_stream(device=None):
        asked.append(device)
        return current[0]

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "device", _no_device_context)
    device = torch.device("cuda", 1)  # not necessarily the current device: the stream is looked up for it
    clock = StageClock(device)
    assert clock.uses_cuda_events
    assert asked == [device]
    current[0] = later  # another stream made current after construction does not move the marks
    for name in BOUNDS:
        clock.mark(name)
    assert asked == [device], "the stream is looked up once, at construction"
    events = [clock._marks[name] for name in BOUNDS]
    assert all(isinstance(e, _FakeEvent) and e.stream is construction for e in events)
    t = clock.timings()
    assert (t.index_ms, t.correction_ms, t.attention_ms) == (1.0, 1.0, 1.0)
    assert all(e.synchronized for e in events[1:])


# ---- host-ahead timing: the spin's lead, redone calls, a call that never lets the host ahead


def test_spin_lead_kept_when_the_host_issued_the_call_in_time():
    assert timing.next_spin_lead_ms(1.5, 2.0) == 2.0
    assert timing.next_spin_lead_ms(timing.HOST_AHEAD_MARGIN * 2.0, 2.0) == 2.0


def test_spin_lead_grows_past_the_host_time_when_the_host_fell_behind():
    lead = timing.next_spin_lead_ms(1.7, 2.0)
    assert lead is not None and lead >= 4.0 and timing.HOST_AHEAD_MARGIN * lead >= 1.7
    # A host time far past the lead: the new lead covers it with the margin, not just doubles.
    lead = timing.next_spin_lead_ms(9.0, 2.0)
    assert lead is not None and timing.HOST_AHEAD_MARGIN * lead >= 9.0


def test_spin_lead_gives_up_past_the_longest_spin():
    assert timing.next_spin_lead_ms(timing.HOST_AHEAD_MAX_LEAD_MS, timing.HOST_AHEAD_MAX_LEAD_MS) is None


class _HostAheadFakes:
    """A fake GPU: ``_sleep`` spins, events read a fake GPU clock, ``perf_counter`` a fake host clock.

    Each call of ``fn`` costs ``host_ms[i]`` of host time and ``gpu_ms`` of GPU time; a spin of ``lead`` ms
    starts the GPU clock after it, so the start event reads the spin's end. With ``syncs`` a call waits
    for the GPU: its host time also covers the spin before it and its own GPU work.
    """

    def __init__(self, host_ms: list[float], gpu_ms: float, cycles_per_ms: float, syncs: bool = False) -> None:
        self.host_ms, self.gpu_ms, self.cycles_per_ms = list(host_ms), gpu_ms, cycles_per_ms
        self.syncs = syncs
        self.host_clock, self.gpu_clock = 0.0, 0.0
        self.spins: list[float] = []
        self.calls = 0

    def perf_counter(self) -> float:
        return self.host_clock / 1e3

    def sleep(self, cycles: int) -> None:
        self.spins.append(cycles / self.cycles_per_ms)
        self.gpu_clock += cycles / self.cycles_per_ms

    def fn(self) -> object:
        self.host_clock += self.host_ms[self.calls] + (self.spins[-1] + self.gpu_ms if self.syncs else 0.0)
        self.gpu_clock += self.gpu_ms
        self.calls += 1
        return f"result {self.calls}"

    def event_class(self):
        fakes = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = -1.0

            def record(self, stream: object = None) -> None:
                self.t = fakes.gpu_clock

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end: Event) -> float:
                return end.t - self.t

        return Event


def _install(monkeypatch, fakes: _HostAheadFakes) -> None:
    monkeypatch.setattr(timing.time, "perf_counter", fakes.perf_counter)
    monkeypatch.setattr(torch.cuda, "_sleep", fakes.sleep)
    monkeypatch.setattr(torch.cuda, "Event", fakes.event_class())


def test_host_ahead_call_times_the_gpu_work_after_the_spin(monkeypatch):
    fakes = _HostAheadFakes(host_ms=[0.5], gpu_ms=3.25, cycles_per_ms=1000.0)
    _install(monkeypatch, fakes)
    ms, result, lead = timing.host_ahead_call(fakes.fn, torch.device("cuda", 0), 1000.0, lead_ms=2.0)
    assert ms == pytest.approx(3.25) and result == "result 1" and lead == 2.0
    assert fakes.spins == [pytest.approx(2.0)]


def test_host_ahead_call_redoes_a_call_the_host_fell_behind_on(monkeypatch):
    # The first try's host time (3 ms) exceeds the 2 ms spin: redone with a longer spin, whose time counts.
    fakes = _HostAheadFakes(host_ms=[3.0, 3.0], gpu_ms=1.0, cycles_per_ms=500.0)
    _install(monkeypatch, fakes)
    ms, result, lead = timing.host_ahead_call(fakes.fn, torch.device("cuda", 0), 500.0, lead_ms=2.0)
    assert fakes.calls == 2 and result == "result 2"
    assert lead > 2.0 and timing.HOST_AHEAD_MARGIN * lead >= 3.0
    assert fakes.spins == [pytest.approx(2.0), pytest.approx(lead)]
    assert ms == pytest.approx(1.0)


def test_host_ahead_call_reports_none_for_a_call_that_syncs(monkeypatch):
    # A call that waits on the GPU is never ahead of its spin, however long: no time, never a wrong one.
    fakes = _HostAheadFakes(host_ms=[0.5] * 16, gpu_ms=1.0, cycles_per_ms=1000.0, syncs=True)
    _install(monkeypatch, fakes)
    ms, _, _ = timing.host_ahead_call(fakes.fn, torch.device("cuda", 0), 1000.0)
    assert ms is None
    assert max(fakes.spins) <= timing.HOST_AHEAD_MAX_LEAD_MS


def test_host_ahead_call_times_a_call_with_tens_of_ms_of_host_work(monkeypatch):
    # A dense 128K call issues in 6-18 ms, with spikes past 25 ms, and never syncs: it must get a time
    # (a 64 ms cap on the spin gave up on it).
    fakes = _HostAheadFakes(host_ms=[30.0, 30.0], gpu_ms=214.0, cycles_per_ms=1000.0)
    _install(monkeypatch, fakes)
    ms, _, lead = timing.host_ahead_call(fakes.fn, torch.device("cuda", 0), 1000.0)
    assert ms == pytest.approx(214.0)
    assert timing.HOST_AHEAD_MARGIN * lead >= 30.0


def test_host_ahead_samples_refuse_the_cpu():
    with pytest.raises(ValueError, match="CUDA device"):
        timing.host_ahead_samples(lambda: None, 3, torch.device("cpu"))


def test_host_ahead_samples_keep_the_lead_that_worked(monkeypatch):
    fakes = _HostAheadFakes(host_ms=[3.0, 3.0, 3.0, 3.0], gpu_ms=2.0, cycles_per_ms=1000.0)
    _install(monkeypatch, fakes)
    monkeypatch.setattr(timing, "spin_cycles_per_ms", lambda device: 1000.0)
    seen: list[tuple[object, bool]] = []
    samples, result = timing.host_ahead_samples(
        fakes.fn, 3, torch.device("cuda", 0), on_call=lambda r, timed: seen.append((r, timed))
    )
    assert samples == [pytest.approx(2.0)] * 3
    assert fakes.calls == 4, "one redo for the first call, none after: the longer lead is reused"
    assert seen == [("result 2", True), ("result 3", True), ("result 4", True)] and result == "result 4"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_idle_host_us_times_each_call_after_a_sync():
    from fpv2.serving.timing import idle_host_us

    calls = []
    us = idle_host_us(lambda: calls.append(torch.cuda.current_stream().query()), calls=7)
    assert len(calls) == 7 and all(calls)  # every call found the GPU idle
    assert us > 0 and round(us, 1) == us


def test_warm_for_calls_until_the_time_has_passed(monkeypatch):
    # A fake clock that advances 3 ms per call: 10 ms of warm-up take 4 calls (0, 3, 6, 9 ms elapsed before them).
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    calls = []

    def fn():
        calls.append(now[0])
        now[0] += 0.003

    assert timing.warm_for(fn, 10.0, torch.device("cpu")) == 4
    assert len(calls) == 4


def test_warm_for_calls_at_least_once():
    calls = []
    assert timing.warm_for(lambda: calls.append(1), 0.0, torch.device("cpu")) == 1
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_for_waits_for_each_call_on_the_gpu():
    device = torch.device("cuda")
    seen = []
    timing.warm_for(
        lambda: (seen.append(torch.cuda.current_stream(device).query()), torch.cuda._sleep(100_000)), 5.0, device
    )
    assert len(seen) >= 2 and all(seen)  # each call found the previous one finished
