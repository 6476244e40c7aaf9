"""Sphinx configuration for the fpv2 documentation.

The docs build from a source tree: the four ``packages/*/src`` folders go on
``sys.path`` so the PEP 420 namespace ``fpv2`` resolves across them without
installing any wheel.  Build with::

    sphinx-build -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from sphinx.application import Sphinx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COMPONENTS = ("kernel", "index", "correction", "serving")

# Source-tree imports: one entry per wheel, in dependency order.
for _name in COMPONENTS:
    _src = ROOT / "packages" / f"fpv2-{_name}" / "src"
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))


def _read_version(component: str) -> str:
    """Version string of one wheel, read from its ``_version.py`` without importing it."""
    path = ROOT / "packages" / f"fpv2-{component}" / "src" / "fpv2" / component / "_version.py"
    match = re.search(r'__version__\s*=\s*"([^"]+)"', path.read_text(encoding="utf-8"))
    return match.group(1) if match else "unknown"


# -- Project -----------------------------------------------------------------
project = "fpv2"
author = "fpv2 contributors"
copyright = "fpv2 contributors"
release = _read_version("kernel")
version = release
# Made available to the pages as |fpv2_kernel_version| etc.
rst_epilog = "\n".join(f".. |fpv2_{name}_version| replace:: {_read_version(name)}" for name in COMPONENTS)

# -- General -----------------------------------------------------------------
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
# intersphinx stays off: the build must not need the network.
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
nitpicky = False
templates_path: list[str] = []

# -- autodoc / napoleon -------------------------------------------------------
autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
}
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_preserve_defaults = True


def _missing(module: str) -> bool:
    """Whether ``module`` cannot be imported here (then autodoc mocks it)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


# Only genuinely optional heavy modules are mocked (torch is a hard dependency): Triton
# (the fpv2-kernel[triton] extra) when the docs environment lacks it.
autodoc_mock_imports = [m for m in ("triton",) if _missing(m)]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_include_init_with_doc = False
napoleon_use_rtype = False
# Attributes sections as field lists: no duplicate targets with dataclass/NamedTuple members.
napoleon_use_ivar = True

# -- HTML ----------------------------------------------------------------------
# furo when it is installed (docs/requirements.txt), alabaster otherwise.
html_theme = "furo" if importlib.util.find_spec("furo") is not None else "alabaster"
html_title = f"fpv2 {release}"
html_static_path: list[str] = []


def _skip_namedtuple_aliases(app: Sphinx, what: str, name: str, obj: object, skip: bool, options: object) -> bool:
    """Hide the ``Alias for field number N`` members of NamedTuples (their Attributes section documents them)."""
    doc = getattr(obj, "__doc__", None) or ""
    if what == "class" and doc.startswith("Alias for field number"):
        return True
    return skip


def setup(app: Sphinx) -> None:
    """Connect the event handlers above."""
    app.connect("autodoc-skip-member", _skip_namedtuple_aliases)
