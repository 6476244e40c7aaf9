"""tools/check_ptxas_report.py: the budget check on ptxas's report of the Hopper kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "check_ptxas_report.py"

_ENTRY = (
    "ptxas info    : Compiling entry function "
    "'_ZN4fpv26hopper14prefill_kernelINS0_13PrefillTraitsILi{head_dim}ELi{stages}EEE"
    "Lb{persistent}ELb{overlap}EEEvNS0_13PrefillParamsIT_EE' "
    "for 'sm_90a'\n"
    "ptxas info    : Function properties for _ZN4fpv26hopper14prefill_kernel...\n"
    "    {stack} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 16 barriers, {stack} bytes cumulative stack size\n"
)


def _entries(
    head_dim: int,
    stages: int,
    default: tuple[int, int, int],
    persistent: tuple[int, int, int],
    overlap: tuple[int, int, int],
) -> str:
    text = ""
    for flags, (stack, stores, loads) in (((0, 0), default), ((1, 0), persistent), ((0, 1), overlap)):
        text += _ENTRY.format(
            head_dim=head_dim, stages=stages, persistent=flags[0], overlap=flags[1], stack=stack, stores=stores,
            loads=loads,
        )  # fmt: skip
    return text


def _report(
    default: tuple[int, int, int],
    persistent: tuple[int, int, int],
    overlap: tuple[int, int, int] = (8, 4, 4),
    d64: tuple[tuple[int, int, int], ...] = ((0, 0, 0), (8, 12, 12), (0, 0, 0)),
) -> str:
    """A build log with the d=128 instantiations (the given frames) and the d=64 ones (``d64``)."""
    text = "[1/3] nvcc ...\n" + _entries(64, 4, *d64) + "[2/3] nvcc ...\n"
    text += _entries(128, 2, default, persistent, overlap)
    return text + "ptxas info    : Compiling entry function '_ZN3fpv211other_kernelEv' for 'sm_90a'\n"


def _run(tmp_path: Path, text: str, *extra: str) -> subprocess.CompletedProcess[str]:
    log = tmp_path / "build.log"
    log.write_text(text)
    return subprocess.run([sys.executable, str(TOOL), str(log), *extra], capture_output=True, text=True)


def test_the_measured_report_passes(tmp_path: Path) -> None:
    result = _run(tmp_path, _report((8, 4, 4), (8, 12, 12)))
    assert result.returncode == 0, result.stdout
    assert "d=128 default instantiation (2 stages): 8 B stack, 4 / 4" in result.stdout
    assert "d=128 persistent instantiation (2 stages): 8 B stack, 12 / 12" in result.stdout
    assert "d=128 overlap instantiation (2 stages): 8 B stack, 4 / 4" in result.stdout
    # The d=64 instantiations are named and budgeted too.
    assert "d=64 default instantiation (4 stages): 0 B stack, 0 / 0" in result.stdout
    assert "d=64 persistent instantiation (4 stages): 8 B stack, 12 / 12" in result.stdout
    assert "d=64 overlap instantiation (4 stages): 0 B stack, 0 / 0" in result.stdout


def test_accumulators_in_local_memory_fail(tmp_path: Path) -> None:
    # The regression this guards against: the consumer main loop made a call, its accumulators on the stack.
    result = _run(tmp_path, _report((944, 44, 36), (8, 12, 12)))
    assert result.returncode == 1
    assert "FAIL: prefill_kernel d=128 (one CTA per tile): 944 bytes stack frame and 44 bytes of spills" in (
        result.stdout
    )


def test_persistent_budget_is_its_own(tmp_path: Path) -> None:
    assert _run(tmp_path, _report((8, 4, 4), (8, 16, 16))).returncode == 0
    result = _run(tmp_path, _report((8, 4, 4), (8, 24, 24)))
    assert result.returncode == 1 and "(persistent)" in result.stdout


def test_overlapped_consumers_have_their_own_budget(tmp_path: Path) -> None:
    # Its flags are (persistent=0, overlap=1), named in a failure: the default 16 / 8 at d=64 and 128 since the
    # 32-bit shared loads (2026-12-05), so the 32 B stack and 28 / 36 B of spills of the builds before fail.
    assert _run(tmp_path, _report((8, 4, 4), (8, 12, 12), overlap=(16, 8, 8))).returncode == 0
    result = _run(tmp_path, _report((8, 4, 4), (8, 12, 12), overlap=(32, 28, 36)))
    assert result.returncode == 1 and "d=128 (overlapped consumers)" in result.stdout
    result = _run(tmp_path, _report((8, 4, 4), (8, 12, 12), d64=((0, 0, 0), (8, 12, 12), (16, 12, 12))))
    assert result.returncode == 1 and "d=64 (overlapped consumers)" in result.stdout


def test_d64_has_the_same_budgets(tmp_path: Path) -> None:
    # Within the d=128 budgets: passes; the gather producer's spills as first compiled at d=64 (20 bytes of
    # spill loads in 24 registers): fails, named by head dim.
    assert _run(tmp_path, _report((8, 4, 4), (8, 12, 12), d64=((16, 8, 8), (16, 16, 16), (16, 8, 8)))).returncode == 0
    result = _run(tmp_path, _report((8, 4, 4), (8, 12, 12), d64=((16, 12, 20), (8, 12, 12), (16, 12, 20))))
    assert result.returncode == 1
    assert "FAIL: prefill_kernel d=64 (one CTA per tile): 16 bytes stack frame and 20 bytes of spills" in result.stdout
    assert "FAIL: prefill_kernel d=64 (overlapped consumers)" in result.stdout
    assert "d=128 (one CTA per tile)" not in result.stdout


def test_a_head_dim_without_a_budget_fails(tmp_path: Path) -> None:
    text = _entries(192, 2, (0, 0, 0), (0, 0, 0), (0, 0, 0))
    result = _run(tmp_path, text)
    assert result.returncode == 1
    expected = "prefill_kernel d=192 (one CTA per tile): no budget for this head dim (budgeted: d=64, 128, 256)"
    assert expected in result.stdout


def test_a_log_without_the_kernel(tmp_path: Path) -> None:
    assert _run(tmp_path, "ninja: no work to do.\n").returncode == 1
    assert _run(tmp_path, "ninja: no work to do.\n", "--allow-missing").returncode == 0


def test_a_missing_log_is_named(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "absent.log")], capture_output=True, text=True)
    assert result.returncode == 1 and "cannot read the build log" in result.stdout and "absent.log" in result.stdout


def _e4m3_entry(head_dim: int, stages: int, stack: int, spill: int) -> str:
    # The FP8 pooled products' instantiation: flags (persistent=0, overlap=1, pooled e4m3=1).
    return _ENTRY.format(
        head_dim=head_dim, stages=stages, persistent=0, overlap="1ELb1", stack=stack, stores=spill, loads=spill
    )


def test_fp8_pooled_products_have_their_own_budget(tmp_path: Path) -> None:
    # The measured 0 / 0 passes at both head dims; the 80 B stack / 92 B of spills of the builds before the
    # 32-bit shared loads (2026-12-05) fail, named as its own variant.
    base = _report((8, 4, 4), (8, 12, 12))
    assert _run(tmp_path, base + _e4m3_entry(128, 2, 0, 0) + _e4m3_entry(64, 4, 0, 0)).returncode == 0
    result = _run(tmp_path, base + _e4m3_entry(128, 2, 80, 92))
    assert result.returncode == 1
    assert "FAIL: prefill_kernel d=128 (overlapped consumers, FP8 pooled products): 80 bytes" in result.stdout
    result = _run(tmp_path, base + _e4m3_entry(64, 4, 32, 32))
    assert result.returncode == 1 and "d=64 (overlapped consumers, FP8 pooled products)" in result.stdout


def _persistent_overlap_entry(head_dim: int, stages: int, stack: int, spill: int) -> str:
    # Persistent CTAs with the overlapped consumers: flags (persistent=1, overlap=1).
    return _ENTRY.format(
        head_dim=head_dim, stages=stages, persistent=1, overlap=1, stack=stack, stores=spill, loads=spill
    )


def test_persistent_overlapped_consumers_have_their_own_budget(tmp_path: Path) -> None:
    # Named apart from the persistent and the overlapped instantiations; the measured 0 / 0 passes, the
    # 72 B stack of the first build (the next tile passed by pointer) fails, and so do the 40 / 104 B of the
    # builds before the uniform tile decode (2026-12-02): 16 / 16 at every head dim but 256.
    base = _report((8, 4, 4), (8, 12, 12))
    result = _run(tmp_path, base + _persistent_overlap_entry(128, 2, 0, 0) + _persistent_overlap_entry(64, 4, 0, 0))
    assert result.returncode == 0, result.stdout
    assert "d=128 persistent-overlap instantiation (2 stages): 0 B stack, 0 / 0" in result.stdout
    result = _run(tmp_path, base + _persistent_overlap_entry(128, 2, 72, 40))
    assert result.returncode == 1
    assert "FAIL: prefill_kernel d=128 (persistent, overlapped consumers): 72 bytes" in result.stdout
    assert _run(tmp_path, base + _persistent_overlap_entry(128, 2, 16, 16)).returncode == 0
    result = _run(tmp_path, base + _persistent_overlap_entry(128, 2, 40, 104))
    assert result.returncode == 1 and "d=128 (persistent, overlapped consumers): 40 bytes" in result.stdout
    result = _run(tmp_path, base + _persistent_overlap_entry(64, 4, 40, 104))
    assert result.returncode == 1 and "d=64 (persistent, overlapped consumers): 40 bytes" in result.stdout


def _dynamic_entry(head_dim: int, stack: int, stores: int, loads: int) -> str:
    """The persistent overlapped consumers fed by the dynamic tile queue: flags (1, 1, 0, 1)."""
    entry = _ENTRY.format(
        head_dim=head_dim, stages=2, persistent=1, overlap=1, stack=stack, stores=stores, loads=loads
    )  # fmt: skip
    return entry.replace("Lb1ELb1EEEvNS0_", "Lb1ELb1ELb0ELb1EEEvNS0_")


def test_the_dynamic_tile_queue_has_its_own_budget(tmp_path: Path) -> None:
    # Named from its fourth flag, not as the static persistent-overlap build; d=256 has the measured
    # exception (200 B of stack, 720 B of spills), d=128 the persistent default (16 / 16).
    text = _report((8, 4, 4), (8, 12, 12)) + _dynamic_entry(128, 8, 4, 4) + _dynamic_entry(256, 200, 288, 720)
    result = _run(tmp_path, text)
    assert result.returncode == 0, result.stdout
    assert "d=128 persistent-dynamic instantiation (2 stages): 8 B stack, 4 / 4" in result.stdout
    assert "d=256 persistent-dynamic instantiation (2 stages): 200 B stack, 288 / 720" in result.stdout
    result = _run(tmp_path, _report((8, 4, 4), (8, 12, 12)) + _dynamic_entry(128, 8, 24, 24))
    assert result.returncode == 1
    assert "d=128 (persistent, dynamic tile queue, overlapped consumers)" in result.stdout


def _second_order_entry(
    head_dim: int, stack: int, spill: int, *, pooled_e4m3: bool = False, split: bool = False
) -> str:
    """The second-order shift's instantiations: flags (0, 1, pooled e4m3, 0, 1), on split-KV traits or not."""
    entry = _ENTRY.format(head_dim=head_dim, stages=2, persistent=0, overlap=1, stack=stack, stores=spill, loads=spill)
    entry = entry.replace("Lb0ELb1EEEvNS0_", f"Lb0ELb1ELb{int(pooled_e4m3)}ELb0ELb1EEEvNS0_")
    return entry.replace("ELi2EEE", "ELi2ELb1EEE") if split else entry


def test_the_second_order_shift_has_its_own_budgets(tmp_path: Path) -> None:
    # Named from its fifth flag (not as the mean correction's overlapped build): the measured frames pass, the
    # ones of the builds before the 32-bit shared loads (2026-12-05) fail under the variant's own name; the
    # split-KV traits keep the flag apart too.
    base = _report((8, 4, 4), (8, 12, 12))
    measured = (
        _second_order_entry(128, 0, 0)
        + _second_order_entry(128, 24, 40, pooled_e4m3=True)
        + _second_order_entry(128, 0, 0, split=True)
        + _second_order_entry(64, 0, 0)
        + _second_order_entry(64, 8, 16, pooled_e4m3=True)
    )
    result = _run(tmp_path, base + measured)
    assert result.returncode == 0, result.stdout
    assert "d=128 overlap-e4m3-second-order instantiation (2 stages): 24 B stack, 40 / 40" in result.stdout
    assert "d=128 split-second-order instantiation (2 stages): 0 B stack, 0 / 0" in result.stdout
    result = _run(tmp_path, base + _second_order_entry(128, 64, 68))
    assert result.returncode == 1
    assert "FAIL: prefill_kernel d=128 (overlapped consumers, second-order shift): 64 bytes" in result.stdout
    result = _run(tmp_path, base + _second_order_entry(128, 64, 136, split=True))
    assert result.returncode == 1 and "d=128 (split-KV, overlapped consumers, second-order shift)" in result.stdout
    result = _run(tmp_path, base + _second_order_entry(128, 128, 192, pooled_e4m3=True))
    assert result.returncode == 1
    result = _run(tmp_path, base + _second_order_entry(64, 8, 16))
    assert result.returncode == 1 and "d=64 (overlapped consumers, second-order shift)" in result.stdout
