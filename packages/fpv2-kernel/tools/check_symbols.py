"""Check that a shared library exports exactly the fpv2 C ABI.

Usage::

    python tools/check_symbols.py [--header include/fpv2/fpv2.h] [--nm nm] libfpv2_kernel.so

Lists the library's dynamic symbols with ``nm -D --defined-only`` and fails (exit 1,
listing the offenders) when

* an exported symbol does not start with ``fpv2_`` (a leak: the static CUDA runtime or C++
  internals would clash with other libraries of the process),
* a function declared ``FPV2_API`` in the header is not exported (a missing ABI entry),
* an exported ``fpv2_`` symbol is not declared in the header (an undocumented export).

Exit status 2 means the tool itself could not run (no ``nm``, unreadable file).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

#: Prefix every exported symbol must carry.
PREFIX = "fpv2_"
#: The in-tree public header, used when ``--header`` is not given.
DEFAULT_HEADER = Path(__file__).resolve().parents[1] / "include" / "fpv2" / "fpv2.h"

_DECLARATION = re.compile(r"\bFPV2_API\b[^;{}()]*?\b(" + PREFIX + r"\w+)\s*\(")


def declared_functions(header_text: str) -> set[str]:
    """Names of the functions a header declares with ``FPV2_API``.

    Args:
        header_text: contents of ``fpv2.h``.

    Returns:
        The declared function names.
    """
    return set(_DECLARATION.findall(header_text))


def exported_symbols(library: Path, nm: str = "nm") -> list[str]:
    """Defined dynamic symbols of a shared library (version suffixes such as ``@@V1`` stripped).

    Args:
        library: path of the ``.so``.
        nm: the ``nm`` executable.

    Returns:
        Symbol names in ``nm`` order.

    Raises:
        RuntimeError: ``nm`` is missing or fails on the file.
    """
    try:
        result = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise RuntimeError(f"cannot run {nm!r}: {exc}") from exc
    if result.returncode != 0:
        raise RuntimeError(f"{nm} -D --defined-only {library} failed: {result.stderr.strip()}")
    names = []
    for line in result.stdout.splitlines():
        fields = line.split()
        if fields:
            names.append(fields[-1].split("@", 1)[0])
    return names


def symbol_problems(exported: list[str], declared: set[str]) -> list[str]:
    """Everything wrong with a library's exports, one sentence per problem (empty when clean).

    Args:
        exported: the library's defined dynamic symbols.
        declared: the functions the header declares.

    Returns:
        Problem descriptions.
    """
    problems = []
    leaked = sorted({name for name in exported if not name.startswith(PREFIX)})
    if leaked:
        problems.append(f"{len(leaked)} exported symbol(s) without the {PREFIX!r} prefix: " + ", ".join(leaked))
    missing = sorted(declared - set(exported))
    if missing:
        problems.append(f"{len(missing)} function(s) declared in the header but not exported: " + ", ".join(missing))
    undeclared = sorted({name for name in exported if name.startswith(PREFIX)} - declared)
    if undeclared:
        problems.append(
            f"{len(undeclared)} exported {PREFIX} symbol(s) not declared in the header: " + ", ".join(undeclared)
        )
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point.

    Args:
        argv: arguments without the program name (``sys.argv[1:]`` when None).

    Returns:
        0 when the exports are exactly the header's functions, 1 when not, 2 when the check cannot run.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("library", type=Path, help="the shared library to check")
    parser.add_argument("--header", type=Path, default=DEFAULT_HEADER, help="the public header (default: in-tree)")
    parser.add_argument("--nm", default="nm", help="nm executable (default: nm)")
    args = parser.parse_args(argv)
    try:
        declared = declared_functions(args.header.read_text())
        exported = exported_symbols(args.library, args.nm)
    except (OSError, RuntimeError) as exc:
        print(f"check_symbols: {exc}", file=sys.stderr)
        return 2
    if not declared:
        print(f"check_symbols: no FPV2_API declarations found in {args.header}", file=sys.stderr)
        return 2
    problems = symbol_problems(exported, declared)
    if problems:
        print(f"check_symbols: {args.library}: FAILED", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(
        f"check_symbols: {args.library}: OK, exports exactly the {len(declared)} fpv2_ functions of {args.header.name}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
