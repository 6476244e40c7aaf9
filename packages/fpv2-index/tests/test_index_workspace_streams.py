"""MaxThresholdStrategy keeps one index workspace per (device, current stream), read as a raw stream handle.

No GPU here: a faked ``torch._C._cuda_getCurrentRawStream`` (workspaces allocate nothing until used).
"""

from __future__ import annotations

import pytest
import torch

from fpv2.index.strategies.max_threshold import MaxThresholdStrategy


def _no_stream_objects(*args, **kwargs):
    raise AssertionError("the workspace key reads the raw stream handle, not torch.cuda.current_stream")


def test_one_workspace_per_device_and_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    current = {0: 11, 1: 21}
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current[index], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", _no_stream_objects)
    strategy = MaxThresholdStrategy()
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    first = strategy._workspace_for(cuda0)
    assert strategy._workspace_for(cuda0) is first  # same stream: reused
    assert strategy._workspace_for(cuda1) is not first  # another device
    current[0] = 12  # another stream made current on device 0
    second = strategy._workspace_for(cuda0)
    assert second is not first
    assert set(strategy._workspaces) == {(cuda0, 11), (cuda1, 21), (cuda0, 12)}
    assert strategy._workspace_for(torch.device("cpu")) is strategy._workspace_for(torch.device("cpu"))
