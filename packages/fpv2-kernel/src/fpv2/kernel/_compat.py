"""Sibling-wheel version pins, re-checked at import time.

Each fpv2 wheel pins its siblings with a compatible-release range in its
metadata. pip enforces that at install time; this check catches the cases pip
does not (``--no-deps`` installs, ``PYTHONPATH`` mixes, editable checkouts).
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import Version


class IncompatibleSiblingError(ImportError):
    """Two fpv2 wheels that are installed together do not fit each other's pins."""


def check_pin(dependent: str, dependent_version: str, requirement: str, installed_version: str | None) -> None:
    """Raise :class:`IncompatibleSiblingError` if ``installed_version`` violates ``requirement``.

    ``None`` (the sibling's metadata is missing, e.g. a source checkout) passes.
    """
    req = Requirement(requirement)
    if installed_version is None:
        return
    if not req.specifier.contains(Version(installed_version), prereleases=True):
        raise IncompatibleSiblingError(
            f"{dependent} {dependent_version} requires {req.name}{req.specifier}, but {req.name} "
            f"{installed_version} is installed; install matching versions, e.g. "
            f"pip install '{req.name}{req.specifier}'"
        )


def check_siblings(dependent: str) -> None:
    """Check every ``fpv2-*`` requirement of the installed distribution ``dependent``."""
    try:
        dist = metadata.distribution(dependent)
    except metadata.PackageNotFoundError:
        return  # running from a source tree: nothing recorded to check
    for line in dist.requires or []:
        req = Requirement(line)
        if not req.name.startswith("fpv2-") or req.marker is not None:
            continue
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            installed = None
        check_pin(dependent, dist.version, line, installed)
