"""Every name the four wheels export (their packages' ``__all__``) is in the Sphinx docs.

A name counts as documented when the docs name it (``.. autofunction:: fpv2.x.y.name`` or a reference), or when
the module that defines it is documented with its members (``.. automodule::`` without ``:no-members:``; the
docs' ``autodoc_default_options`` include members). Runs from a repository checkout only (the docs are not in
the wheels).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[3] / "docs"
#: The exported packages: each wheel's top level and its public subpackages.
PACKAGES = (
    "fpv2.kernel",
    "fpv2.kernel.reference",
    "fpv2.index",
    "fpv2.correction",
    "fpv2.correction.diagnostics",
    "fpv2.serving",
)
_AUTOMODULE = re.compile(r"^\.\. automodule:: (\S+)\s*\n((?:[ \t]+:[^\n]*\n)*)", re.MULTILINE)


def _docs_text() -> str:
    if not DOCS.is_dir():
        pytest.skip("the docs/ folder is not in this checkout")
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.rglob("*.rst")))


def _modules_with_members(text: str) -> set[str]:
    return {name for name, options in _AUTOMODULE.findall(text) if ":no-members:" not in options}


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_documented(package):
    text = _docs_text()
    with_members = _modules_with_members(text)
    module = importlib.import_module(package)
    missing = []
    for name in getattr(module, "__all__", ()):
        if name.startswith("__"):
            continue  # __version__
        defined_in = getattr(getattr(module, name), "__module__", package)
        if re.search(rf"\b{re.escape(name)}\b", text) or defined_in in with_members:
            continue
        missing.append(f"{package}.{name} (defined in {defined_in})")
    assert not missing, "exported but not in the docs: " + ", ".join(missing)


def test_the_automodule_rule_reads_no_members():
    text = ".. automodule:: a.b\n   :no-members:\n\n.. automodule:: a.c\n\n.. automodule:: a.d\n   :members:\n"
    assert _modules_with_members(text) == {"a.c", "a.d"}
