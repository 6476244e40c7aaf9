"""Census of the Hopper prefill kernel's innermost wgmma loops in its SASS, per instantiation.

For every ``prefill_kernel`` instantiation of a built library (or a saved ``cuobjdump -sass`` listing) it
finds the innermost loops that issue HGMMA (a backward branch whose body holds no other backward branch)
and prints, per loop, the instructions of one trip and how many are HGMMA, MUFU, R2UR (vector-to-uniform
moves: descriptors or addresses computed in vector registers), uniform-datapath instructions, and local
loads / stores. A step of the kept-block loop issues these instructions once per consumer warp, so two
instantiations' loops can be compared without a GPU: e.g. the persistent overlapped consumers' unmasked
loop at d=128 takes 748 instructions a step, 48 of them R2UR and 3 uniform, against 712, 16 and 45 for one
CTA per tile (2026-12-02; benchmarks/NOTES.md).

Usage::

    python packages/fpv2-kernel/tools/sass_loop_census.py build/kernel/libfpv2_kernel.so [--filter d=128]

cuobjdump comes from ``$CUOBJDUMP``, then ``PATH``, then the copy bundled with Triton's NVIDIA backend.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The same variant names as the ptxas budgets.
from check_ptxas_report import _TRAITS, _variant

_FUNCTION = re.compile(r"Function : (?P<name>\S+)")
_INSTRUCTION = re.compile(r"/\*(?P<address>[0-9a-f]{4,})\*/\s+(?P<text>[^;]*);")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x(?P<target>[0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclass(frozen=True)
class LoopCensus:
    """One innermost HGMMA loop: its instruction range (indices in the function) and opcode counts."""

    first: int
    last: int
    opcodes: Counter

    @property
    def instructions(self) -> int:
        return self.last - self.first + 1

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (``HGMMA``, ``MUFU``, ...)."""
        return sum(n for op, n in self.opcodes.items() if op.startswith(prefix))

    @property
    def uniform(self) -> int:
        """Uniform-datapath instructions (opcodes U*, not counting the vector-to-uniform moves)."""
        return sum(n for op, n in self.opcodes.items() if op.startswith("U"))


def _opcode(text: str) -> str:
    return _PREDICATE.sub("", text.strip()).split()[0]


def innermost_hgmma_loops(instructions: list[tuple[int, str]]) -> list[LoopCensus]:
    """The innermost loops that issue HGMMA: a backward branch's range with HGMMA and no other such range inside.

    Args:
        instructions: ``(address, text)`` of one function, in address order.
    """
    index_of = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        match = _BRANCH_TARGET.search(text)
        if match is None:
            continue
        target = int(match.group("target"), 16)
        if target >= address or target not in index_of:
            continue
        first = index_of[target]
        loops.append((first, i))
    with_hgmma = [
        LoopCensus(first, last, Counter(_opcode(text) for _, text in instructions[first : last + 1]))
        for first, last in loops
    ]
    # A range with an EXIT is not a loop body: ptxas places the barriers' retry blocks after the kernel's
    # exits, and their branches back into the loops look like backward branches spanning the tail.
    with_hgmma = [loop for loop in with_hgmma if loop.count("HGMMA") and not loop.count("EXIT")]
    # Innermost: no other HGMMA loop inside (a barrier's retry branch inside the body does not count).
    return [
        loop
        for loop in with_hgmma
        if not any(
            loop.first <= other.first
            and other.last <= loop.last
            and other is not loop
            and (other.first, other.last) != (loop.first, loop.last)
            for other in with_hgmma
        )
    ]


def parse_functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """``{mangled name: [(address, instruction text), ...]}`` of a ``cuobjdump -sass`` listing."""
    functions: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in sass.splitlines():
        function = _FUNCTION.search(line)
        if function is not None:
            current = functions.setdefault(function.group("name"), [])
            continue
        instruction = _INSTRUCTION.search(line)
        if instruction is not None and current is not None:
            current.append((int(instruction.group("address"), 16), instruction.group("text")))
    return functions


def label(name: str) -> str:
    """``d=128 overlap`` for a prefill_kernel instantiation (the ptxas budget names), else the name."""
    traits = _TRAITS.search(name)
    head_dim = traits.group("head_dim") if traits else "?"
    return f"d={head_dim} {_variant(name)}"


def _cuobjdump() -> str:
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    sys.exit("sass_loop_census: no cuobjdump (set CUOBJDUMP, put one on PATH, or install triton)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary", type=Path, help="a library / cubin, or a saved cuobjdump -sass listing (.sass)")
    parser.add_argument("--filter", default="", help="only instantiations whose label contains this text")
    args = parser.parse_args(argv)
    if args.binary.suffix == ".sass":
        sass = args.binary.read_text()
    else:
        sass = subprocess.run(
            [_cuobjdump(), "-sass", str(args.binary)], check=True, capture_output=True, text=True
        ).stdout
    rows = 0
    for name, instructions in parse_functions(sass).items():
        if "prefill_kernel" not in name or args.filter not in label(name):
            continue
        for loop in innermost_hgmma_loops(instructions):
            rows += 1
            print(
                f"{label(name):28s} loop @{loop.first:5d}: {loop.instructions:5d} instructions, "
                f"HGMMA {loop.count('HGMMA'):3d}, MUFU {loop.count('MUFU'):3d}, R2UR {loop.count('R2UR'):3d}, "
                f"uniform {loop.uniform:3d}, LDL {loop.count('LDL'):2d}, STL {loop.count('STL'):2d}"
            )
    if rows == 0:
        print("sass_loop_census: no prefill_kernel loop with HGMMA found", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
