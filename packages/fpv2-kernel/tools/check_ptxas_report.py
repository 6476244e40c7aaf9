"""Fail when ptxas gave the Hopper prefill kernel a stack frame or spills beyond its known budget.

The kernel runs its producer warpgroup in 24 registers and its consumers in 240; ptxas's choices there
are fragile: one more branch in the tile order once made the consumer main loop a call whose output
accumulators went to local memory (a 944-byte stack frame, every accumulator update through memory),
with no error and no warning. This check reads the ``-Xptxas -v`` report of a build (``cmake --build -v``
output) and compares each ``prefill_kernel`` instantiation with a budget, so that regression fails the
build's checks instead of a timing run on the device. Instantiations are named by head dim and variant
(``d=64 overlap``); an instantiation of a head dim without a budget fails until one is written here.

Usage::

    cmake --build build -v 2>&1 | python tools/check_ptxas_report.py -
    python tools/check_ptxas_report.py build.log

Exit status 0 when every instantiation found is within budget (or, with ``--allow-missing``, when the
log holds no report: an incremental build that did not recompile the kernel), 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

#: Per variant (named from the kernel's bool template arguments: persistent CTAs, overlapped consumers; the
#: persistent overlapped consumers measured 0 / 0 at both head dims, 2026-12-01, sixth session):
#: stack bytes, spill bytes, the same for every built head dim (csrc/hopper/prefill_instances.hpp) ...
VARIANT_BUDGETS = {
    "default": (16, 8),
    "persistent": (16, 16),
    "persistent-overlap": (16, 16),
    "persistent-dynamic": (16, 16),
    "overlap": (16, 8),
    "overlap-e4m3": (16, 8),
    "split": (16, 8),
    "overlap-second-order": (16, 8),
    "overlap-e4m3-second-order": (16, 8),
    "split-second-order": (16, 8),
}
#: ... except where a measured instantiation needs its own. Measured with nvcc 13.0 at producer / consumer
#: registers 32 / 232 (benchmarks/NOTES.md, 2026-12-01, third session): 0 / 0 everywhere but the d=128
#: overlapped consumers, 32 B stack and 36 B of spills, all outside the loops (the prologue, the entry of the
#: pooled-tile loop, the epilogue; no spill between a loop's backward branch and its target in the SASS),
#: and measured no slower than before.
#: The d=128 overlapped consumers with the FP8 pooled products (third flag, opt-in, 2026-12-01, fifth
#: session): 80 B stack, 76-80 / 88-100 B of spill stores / loads (with the head-major tile order), the same
#: whether the first pooled tile overlaps the last kept PV product or not and larger (112 B stack, 196 B of
#: spills) when Q and P are converted 4 values at a time; measured slower than the bf16 pooled products
#: anyway (benchmarks/NOTES.md).
#: The d=128 persistent overlapped consumers (opt-in, measured slower than one CTA per tile) with the 16-byte
#: epilogue stores (2026-12-01, seventh session): 40 B stack, 40 / 104 B of spills, the epilogue's shuffles and
#: stores beside the next tile's state; 0 / 0 with the 4-byte stores before.
#: d=256 (64-token KV tiles, 128 fp32 accumulators of O per consumer thread; 2026-12-01, eighth session), at
#: its own producer / consumer registers 24 / 240: the one-CTA-per-tile consumers 8 B stack, 4 / 4 B of spills;
#: the overlapped ones (the default, 12% faster dense than the others) 56 B stack, 56 / 64 B; the opt-in
#: persistent instantiations more (88 B / 208 / 296 B, and 280 B / 488 / 884 B overlapped). At 32 / 232 the
#: overlapped consumers had 96 B / 128 / 136 B and measured 2.4% slower with the correction at 128K, 1% faster
#: dense (benchmarks/NOTES.md). No FP8 pooled-product instantiation at d=256 (the launcher refuses the E4M3
#: copies there).
#: The split-KV instantiations (the overlapped consumers with the schedule's split ranges and the fp32
#: partial-row epilogue, launched only for calls with fewer CTAs than SMs; 2026-12-01, eighth session): d=64
#: 0 / 0, d=128 64 B stack, 104 / 108 B of spills, d=256 96 B, 320 / 352 B. The other instantiations are
#: unchanged by them (the split is a template flag of the traits).
#: The kept-block work order (one more load through params.tile_order at a tile's start; 2026-12-02, ninth
#: session) leaves every one-CTA-per-tile instantiation as it was. The persistent consumers decoding each tile
#: straight-line from a broadcast index (the same session: their loops back on the uniform datapath) spill
#: less: d=128 persistent-overlap 0 / 0 (40 B stack, 40 / 104 B before), d=256 persistent 40 B, 80 / 72 B (96 B,
#: 212 / 304 B), overlapped 192 B, 292 / 724 B (272 B, 488 / 892 B).
#: The persistent overlapped consumers fed by the dynamic tile queue (fourth flag, opt-in, same session):
#: d=128 8 B stack, 4 / 4 B; d=256 200 B, 288 / 720 B (about the static snake order's d=256 build).
#: The lane-pair gather as the only gather layout (2026-12-03; the row, shared-rows and warp layouts removed, the
#: producer's lane rows re-read from %laneid at each use): every d=64 instantiation 0 / 0; d=256 one CTA per
#: tile 0 / 0 (8 B, 4 / 4 B before), split 56 B, 100 / 104 B (96 B, 320 / 352 B), overlapped 64 B, 60 / 68 B
#: (56 B, 56 / 64 B); d=128 split 32 B, 52 / 56 B (64 B, 104 / 108 B); the others as they were.
#: The second-order mass shift (fifth flag, opt-in with a plan's key spread; 2026-12-05, twenty-third session),
#: built for the one-CTA-per-tile overlapped consumers only: d=64 0 / 0 (FP8 pooled products 32 B stack, 28 / 44
#: B), d=128 64 B, 60 / 68 B (FP8 pooled 128 B, 176 / 192 B; split 64 B, 112 / 136 B), d=256 440 B, 644 / 652 B
#: (split 432 B, 676 / 700 B): the per-row coefficients and the spread loads on top of the mean correction's
#: state, in the pooled-tile loop; not yet timed. With a runtime switch instead of the flag the mean kernels
#: spilled more too (d=128 overlapped 144 / 152 B); with the flag they are as before.
#: The shift and spread tables and the second-order shift's Q rows read by 32-bit shared addresses (LDS.64 /
#: LDS.128 instead of CuTe's 64-bit generic pointers; 2026-12-05, twenty-fourth session): every d=128
#: one-CTA-per-tile instantiation 0 / 0 but the FP8 pooled second-order one (24 B stack, 40 / 40 B), d=64 FP8
#: pooled second order 8 B, 8 / 16 B, d=256 overlapped and split 0 / 0, their second-order builds 32 B, 52 / 60 B
#: and 32 B, 56 / 76 B; the persistent d=256 builds about as before (overlapped 192 B, 304 / 700 B; dynamic 200 B,
#: 288 / 688 B). The exceptions below are those figures; the budgets the change made unnecessary are gone.
BUDGET_EXCEPTIONS = {
    (64, "overlap-e4m3-second-order"): (8, 16),
    (128, "overlap-e4m3-second-order"): (24, 40),
    (256, "overlap-second-order"): (32, 60),
    (256, "split-second-order"): (32, 76),
    (256, "persistent"): (40, 80),
    (256, "persistent-overlap"): (192, 724),
    (256, "persistent-dynamic"): (200, 720),
}
BUDGETS = {
    (head_dim, variant): BUDGET_EXCEPTIONS.get((head_dim, variant), budget)
    for head_dim in (64, 128, 256)
    for variant, budget in VARIANT_BUDGETS.items()
    if not (head_dim == 256 and variant.startswith("overlap-e4m3"))
}

# Itanium mangling of the bool template arguments: Lb0E (false) / Lb1E (true), in declaration order.
_FLAGS = re.compile(r"Lb([01])E")
# The traits argument PrefillTraits<kHeadDim, kStages, kSplitKv>: ...PrefillTraitsILi128ELi2ELb0EEE... (the
# split-KV flag is absent from names built before it existed).
_TRAITS = re.compile(r"PrefillTraitsILi(?P<head_dim>\d+)ELi(?P<stages>\d+)E(?:Lb(?P<split>[01])E)?E")
_KINDS = {
    "default": "one CTA per tile",
    "persistent": "persistent",
    "persistent-overlap": "persistent, overlapped consumers",
    "persistent-dynamic": "persistent, dynamic tile queue, overlapped consumers",
    "overlap": "overlapped consumers",
    "overlap-e4m3": "overlapped consumers, FP8 pooled products",
    "split": "split-KV, overlapped consumers",
    "overlap-second-order": "overlapped consumers, second-order shift",
    "overlap-e4m3-second-order": "overlapped consumers, FP8 pooled products, second-order shift",
    "split-second-order": "split-KV, overlapped consumers, second-order shift",
}

_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']*prefill_kernel[^']*)'")
_FRAME = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
)


@dataclass(frozen=True)
class KernelReport:
    """What ptxas reported for one ``prefill_kernel`` instantiation."""

    name: str
    variant: str
    head_dim: int | None  # None: a name without PrefillTraits<d, stages>
    stages: int | None
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def label(self) -> str:
        """``d=64 overlap``: the head dim and the variant."""
        return f"d={self.head_dim if self.head_dim is not None else '?'} {self.variant}"


def _variant(name: str) -> str:
    """The instantiation's name in BUDGETS, from its template flags (persistent, overlap, pooled e4m3, dynamic
    tile queue, second-order shift) and the traits' split-KV flag."""
    traits = _TRAITS.search(name)
    split = traits is not None and traits.group("split") == "1"
    if traits is not None:
        name = name[: traits.start()] + name[traits.end() :]  # the kernel's own flags follow the traits
    flags = [flag == "1" for flag in _FLAGS.findall(name)]
    persistent, overlap, pooled_e4m3, dynamic_tiles, second_order = [*flags, *[False] * 5][:5]
    if split:
        return "split-second-order" if second_order else "split"
    if second_order:
        return "overlap-e4m3-second-order" if pooled_e4m3 else "overlap-second-order"
    if persistent and dynamic_tiles:
        return "persistent-dynamic"
    if persistent:
        return "persistent-overlap" if overlap else "persistent"
    if overlap:
        return "overlap-e4m3" if pooled_e4m3 else "overlap"
    return "default"


def parse_reports(text: str) -> list[KernelReport]:
    """The ``prefill_kernel`` entries of a ptxas ``-v`` report, in the order they appear."""
    reports = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        entry = _ENTRY.search(line)
        if entry is None:
            continue
        for follow in lines[i + 1 : i + 4]:
            frame = _FRAME.search(follow)
            if frame is not None:
                name = entry.group("name")
                traits = _TRAITS.search(name)
                reports.append(
                    KernelReport(
                        name=name,
                        variant=_variant(name),
                        head_dim=int(traits.group("head_dim")) if traits else None,
                        stages=int(traits.group("stages")) if traits else None,
                        stack_bytes=int(frame.group("stack")),
                        spill_store_bytes=int(frame.group("stores")),
                        spill_load_bytes=int(frame.group("loads")),
                    )
                )
                break
    return reports


def over_budget(report: KernelReport) -> str | None:
    """Why ``report`` exceeds its budget (or has none), or None."""
    where = f"prefill_kernel d={report.head_dim} ({_KINDS[report.variant]})"
    budget = BUDGETS.get((report.head_dim, report.variant))
    if budget is None:
        known = ", ".join(str(d) for d in sorted({d for d, _ in BUDGETS}))
        return f"{where}: no budget for this head dim (budgeted: d={known}); add it to BUDGETS"
    max_stack, max_spill = budget
    spill = max(report.spill_store_bytes, report.spill_load_bytes)
    if report.stack_bytes > max_stack or spill > max_spill:
        return (
            f"{where}: {report.stack_bytes} bytes stack frame and {spill} bytes of spills, "
            f"budget {max_stack} / {max_spill}: ptxas moved kernel state to local memory"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="build output holding the ptxas -v report, or - for standard input")
    parser.add_argument("--allow-missing", action="store_true", help="pass when the log has no report")
    args = parser.parse_args(argv)
    try:
        text = sys.stdin.read() if args.log == "-" else open(args.log, encoding="utf-8", errors="replace").read()
    except OSError as exc:
        print(f"check_ptxas_report: cannot read the build log {args.log!r}: {exc.strerror}")
        return 1
    reports = parse_reports(text)
    if not reports:
        print(
            "check_ptxas_report: no prefill_kernel entry in the ptxas report"
            + (" (allowed)" if args.allow_missing else "")
        )
        return 0 if args.allow_missing else 1
    failures = [why for why in map(over_budget, reports) if why]
    for report in reports:
        stages = f" ({report.stages} stages)" if report.stages is not None else ""
        print(
            f"check_ptxas_report: {report.label} instantiation{stages}: "
            f"{report.stack_bytes} B stack, {report.spill_store_bytes} / {report.spill_load_bytes} "
            "B spill stores / loads"
        )
    for why in failures:
        print(f"check_ptxas_report: FAIL: {why}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
