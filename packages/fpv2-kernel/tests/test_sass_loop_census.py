"""tools/sass_loop_census.py: the innermost HGMMA loops of a cuobjdump -sass listing and their opcode counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "sass_loop_census.py"

_KERNEL = (
    "_ZN4fpv26hopper14prefill_kernelINS0_13PrefillTraitsILi{d}ELi{stages}ELb0EEE{flags}EEvNS0_13PrefillParamsIT_EE"
)
_NAMES = {
    "overlap": _KERNEL.format(d=128, stages=2, flags="Lb0ELb1ELb0E"),
    "persistent": _KERNEL.format(d=64, stages=4, flags="Lb1ELb0ELb0E"),
}


def _function(name: str, body: list[str]) -> str:
    """A cuobjdump-style listing of one function: each instruction at the next 16-byte address."""
    lines = [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"']
    for i, text in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;  /* 0x000000000000 */")
        lines.append("                                                   /* 0x000fe20000000800 */")
    return "\n".join(lines) + "\n"


def _listing() -> str:
    overlap = [
        "S2R R0, SR_TID.X",  # 0
        "R2UR UR4, R0",  # 1: loop head (0x10)
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",  # 2
        "UIADD3 UR5, UR5, 0x1, URZ",  # 3
        "MUFU.EX2 R3, R3",  # 4
        "@P0 BRA 0x10",  # 5: back to the head: a 5-instruction loop
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x28000], R2",  # 6: a wait with a retry block below
        "@!P0 BRA 0xa0",  # 7
        "EXIT",  # 8
        "BRA 0x80",  # 9
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x28000], R2",  # 10: the retry block (0xa0)
        "@!P0 BRA 0xa0",  # 11
        "BRA 0x20",  # 12: back into the loop over the exit: not a loop body
    ]
    persistent = [
        "R2UR UR4, R0",  # 0: loop head
        "R2UR UR6, R1",  # 1
        "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT",  # 2
        "LDL R5, [R1+0x8]",  # 3
        "BRA 0x0",  # 4
        "EXIT",  # 5
    ]
    return _function(_NAMES["overlap"], overlap) + _function(_NAMES["persistent"], persistent)


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    listing = tmp_path / "kernel.sass"
    listing.write_text(_listing())
    return subprocess.run([sys.executable, str(TOOL), str(listing), *args], capture_output=True, text=True)


def test_census_counts_one_trip_of_each_innermost_loop(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 0, result.stderr
    rows = result.stdout.strip().splitlines()
    assert len(rows) == 2, rows  # the retry block's branch back over EXIT is not a loop
    overlap, persistent = rows
    assert overlap.startswith("d=128 overlap ")
    assert "5 instructions" in overlap and "HGMMA   1" in overlap and "MUFU   1" in overlap
    assert "R2UR   1" in overlap and "uniform   1" in overlap and "LDL  0" in overlap
    assert persistent.startswith("d=64 persistent ")
    assert "5 instructions" in persistent and "R2UR   2" in persistent and "uniform   0" in persistent
    assert "LDL  1" in persistent


def test_census_filters_by_label_and_fails_when_nothing_matches(tmp_path):
    only = _run(tmp_path, "--filter", "d=64")
    assert only.returncode == 0 and len(only.stdout.strip().splitlines()) == 1
    none = _run(tmp_path, "--filter", "d=256")
    assert none.returncode == 1 and "no prefill_kernel loop" in none.stderr
