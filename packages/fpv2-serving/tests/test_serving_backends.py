"""The attention backend registry: resolution order, errors, no silent fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from fpv2.kernel.reference.sparse import sparse_attention
from fpv2.kernel.testing import planted_workload
from fpv2.serving import SparsePrefillPipeline, available_backends
from fpv2.serving import backends as registry


class FakeBackend:
    """A backend whose availability is fixed; run() returns zeros so a wrong pick shows."""

    def __init__(self, name: str, ok: bool, reason: str) -> None:
        self.name, self._ok, self._reason = name, ok, reason

    def available(self) -> tuple[bool, str]:
        return self._ok, self._reason

    def run(self, q, k_cache, v_cache, batch, index, plan, *, softmax_scale, q_descale, k_descale, v_descale):
        return torch.zeros_like(q)


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return registry


def test_reference_is_registered_and_available():
    assert "reference" in available_backends()
    assert registry.registered_backends() == ["hopper", "triton", "reference"]
    assert registry.resolve_backend("reference").name == "reference"
    status = registry.backend_status()
    assert set(status) == {"hopper", "triton", "reference"}
    assert status["reference"][0] is True
    # auto prefers hopper, then triton on a CUDA GPU (never the interpreter), then the reference.
    if status["hopper"][0]:
        expected = "hopper"
    elif status["triton"][0] and torch.cuda.is_available():
        expected = "triton"
    else:
        expected = "reference"
    assert registry.resolve_backend("auto").name == expected


def test_triton_backend_is_not_auto_selected_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_backend = registry.resolve_backend("triton")  # usable by name
    assert triton_backend.available()[1].startswith("Triton") and "interpreter" in triton_backend.available()[1]
    assert registry.resolve_backend("auto").name in ("hopper", "reference")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="'triton' is not available: no CUDA GPU"):
        registry.resolve_backend("triton")


def test_auto_skips_unavailable_and_takes_priority_order(clean_registry):
    clean_registry.register_backend(FakeBackend("broken", False, "no such device"), priority=-10)
    assert clean_registry.resolve_backend("auto").name != "broken"
    clean_registry.register_backend(FakeBackend("fast", True, "ok"), priority=-5)
    assert clean_registry.resolve_backend("auto").name == "fast"
    assert clean_registry.available_backends()[0] == "fast"
    assert "broken" not in clean_registry.available_backends()


def test_unknown_name_lists_the_names():
    with pytest.raises(ValueError, match="unknown attention backend 'cutile'") as info:
        registry.resolve_backend("cutile")
    assert "reference" in str(info.value) and "hopper" in str(info.value) and "auto" in str(info.value)


def test_named_unavailable_backend_raises_with_reason(clean_registry):
    clean_registry.register_backend(FakeBackend("broken", False, "needs an sm_90 GPU"), priority=-10)
    with pytest.raises(RuntimeError, match="'broken' is not available: needs an sm_90 GPU"):
        clean_registry.resolve_backend("broken")
    # The pipeline refuses too, instead of running on another backend.
    with pytest.raises(RuntimeError, match="needs an sm_90 GPU"):
        SparsePrefillPipeline(backend="broken")


def test_hopper_named_explicitly_never_falls_back():
    ok, reason = registry.HopperBackend().available()
    if ok:
        pytest.skip("the Hopper kernel is available here")
    assert reason
    with pytest.raises(RuntimeError, match="'hopper' is not available"):
        SparsePrefillPipeline(backend="hopper")


def test_registration_checks(clean_registry):
    with pytest.raises(TypeError, match="backend must provide"):
        clean_registry.register_backend(object(), priority=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        clean_registry.register_backend(FakeBackend("auto", True, ""), priority=0)
    with pytest.raises(TypeError, match="backend must be a name"):
        clean_registry.resolve_backend(3)  # type: ignore[arg-type]


def test_backend_object_is_used_by_the_pipeline():
    wl = planted_workload([256], num_q_heads=2, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    result = SparsePrefillPipeline(strategy="dense", correction=False, backend=FakeBackend("zeros", True, "ok"))(
        wl.q, wl.k_cache, wl.v_cache, wl.batch
    )
    assert torch.count_nonzero(result.out) == 0


def test_reference_backend_matches_sparse_attention_and_casts():
    wl = planted_workload([512], num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=5)
    pipe = SparsePrefillPipeline(strategy="dense", correction=False, backend="reference")
    result = pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    direct = sparse_attention(wl.q, wl.k_cache, wl.v_cache, wl.batch, result.index)
    assert result.out.dtype == torch.bfloat16
    torch.testing.assert_close(result.out, direct.to(torch.bfloat16), rtol=0, atol=0)


@pytest.fixture
def fresh_auto_log(monkeypatch):
    monkeypatch.setattr(registry, "_REPORTED_AUTO_CHOICES", set())


@pytest.mark.parametrize(("major", "level"), [(9, "WARNING"), (8, "INFO")])
def test_auto_logs_a_missing_hopper_kernel_once(clean_registry, fresh_auto_log, monkeypatch, caplog, major, level):
    # The product's fast path missing on a Hopper GPU must not pass unnoticed; elsewhere it is expected.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (major, 0))
    clean_registry.register_backend(FakeBackend("hopper", False, "libfpv2_kernel.so not found"), priority=0)
    clean_registry.register_backend(FakeBackend("triton", True, "ok"), priority=1)
    caplog.set_level(logging.INFO, logger="fpv2.serving")
    assert clean_registry.resolve_backend("auto").name == "triton"
    assert clean_registry.resolve_backend("auto").name == "triton"
    records = [r for r in caplog.records if r.name == "fpv2.serving"]
    assert len(records) == 1, "logged once per process, not per call"
    assert records[0].levelname == level
    assert "chose 'triton'" in records[0].getMessage()
    assert "hopper: libfpv2_kernel.so not found" in records[0].getMessage()


def test_auto_logs_nothing_when_the_first_choice_is_available(clean_registry, fresh_auto_log, caplog):
    clean_registry.register_backend(FakeBackend("fast", True, "ok"), priority=-5)
    caplog.set_level(logging.INFO, logger="fpv2.serving")
    assert clean_registry.resolve_backend("auto").name == "fast"
    assert not [r for r in caplog.records if r.name == "fpv2.serving"]
