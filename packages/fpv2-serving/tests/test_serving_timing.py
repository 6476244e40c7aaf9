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
