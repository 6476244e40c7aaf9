"""``fpv2.serving.environment.gpu_clock_state``: the SM clock and power a benchmark row records."""

from __future__ import annotations

import subprocess

import pytest
import torch

from fpv2.serving import environment

CUDA0 = torch.device("cuda", 0)


def test_the_cpu_has_no_clock_state():
    assert environment.gpu_clock_state(torch.device("cpu")) is None


def test_nvml_readings_in_mhz_and_watts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: 1755)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 691_230)  # milliwatts
    assert environment.gpu_clock_state(CUDA0) == {"sm_mhz": 1755.0, "watts": 691.2, "source": "nvml"}


def _no_nvml(monkeypatch):
    def missing(device):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "clock_rate", missing)
    monkeypatch.setattr(torch.cuda, "power_draw", missing)


def test_without_nvml_nvidia_smi_answers_for_the_device_index(monkeypatch):
    _no_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    asked = []

    def fake_run(args, **kwargs):
        asked.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="1980, 131.70\n", stderr="")

    monkeypatch.setattr(environment.subprocess, "run", fake_run)
    assert environment.gpu_clock_state(torch.device("cuda", 3)) == {
        "sm_mhz": 1980.0,
        "watts": 131.7,
        "source": "nvidia-smi",
    }
    assert "--id=3" in asked[0]


def test_renumbered_devices_or_unreadable_output_give_none(monkeypatch):
    _no_nvml(monkeypatch)

    def fail(*args, **kwargs):
        raise AssertionError("nvidia-smi numbers the machine's devices, not the visible ones: not asked")

    monkeypatch.setattr(environment.subprocess, "run", fail)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert environment.gpu_clock_state(CUDA0) is None

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(
        environment.subprocess,
        "run",
        lambda args, **kwargs: subprocess.CompletedProcess(args, 0, stdout="[N/A], [N/A]\n", stderr=""),
    )
    assert environment.gpu_clock_state(CUDA0) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_gpu_reports_a_plausible_clock():
    state = environment.gpu_clock_state(torch.device("cuda"))
    if state is None:
        pytest.skip("neither NVML nor nvidia-smi answered here")
    assert 100.0 <= state["sm_mhz"] <= 4000.0 and 0.0 < state["watts"] < 2000.0


def test_a_gpu_bench_row_carries_the_clock_before_and_after():
    from fpv2.serving.bench import _Measured

    clock = {"before": {"sm_mhz": 1515.0, "watts": 690.8, "source": "nvml"}, "after": None}
    timed = _Measured([1.0], [], None, gpu_samples=[0.9], host_ahead_tried=True, clock=clock)
    assert timed.gpu_fields()["gpu_clock"] == clock and timed.gpu_fields()["gpu_ms"] == 0.9
    never_ahead = _Measured([1.0], [], None, gpu_samples=None, host_ahead_tried=True, clock=clock)
    assert never_ahead.gpu_fields() == {
        "gpu_ms": None,
        "gpu_note": "the host never got ahead: the call waits on the GPU",
        "gpu_clock": clock,
    }
    assert _Measured([1.0], [], None).gpu_fields() == {}  # the CPU: no clock, no GPU columns
