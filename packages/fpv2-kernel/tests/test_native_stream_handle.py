"""The binding's default stream: q's device's current stream, read as a raw handle (no Stream object built).

No GPU here: a stand-in for a CUDA tensor and a faked ``torch._C._cuda_getCurrentRawStream``.
"""

from __future__ import annotations

import pytest
import torch

from fpv2.kernel._native import structs as cs


class _CudaLike:
    """What ``_stream_handle`` reads of a CUDA tensor."""

    is_cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device


def _no_stream_objects(*args, **kwargs):
    raise AssertionError("the default stream is read as a raw handle, not through torch.cuda.current_stream")


@pytest.fixture
def raw_streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Devices asked for; device ``i``'s current stream is handle ``1000 + i`` (0 for device 5)."""
    asked: list[int] = []

    def raw(index: int) -> int:
        asked.append(index)
        return 0 if index == 5 else 1000 + index

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", _no_stream_objects)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    return asked


def test_default_stream_is_the_current_raw_stream_of_qs_device(raw_streams: list[int]) -> None:
    assert cs._stream_handle(None, _CudaLike(torch.device("cuda", 3))) == 1003
    assert cs._stream_handle(None, _CudaLike(torch.device("cuda"))) == 1002  # no index: the current device
    assert cs._stream_handle(None, _CudaLike(torch.device("cuda", 5))) is None  # the legacy default stream
    assert raw_streams == [3, 2, 5]


def test_cpu_tensors_and_explicit_streams_read_no_current_stream(raw_streams: list[int]) -> None:
    assert cs._stream_handle(None, torch.zeros(1)) is None
    assert cs._stream_handle(77, _CudaLike(torch.device("cuda", 3))) == 77
    assert raw_streams == []
