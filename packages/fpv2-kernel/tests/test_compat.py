"""Sibling pins are re-checked at import with a message naming both versions."""

from __future__ import annotations

from importlib import metadata

import pytest

from fpv2.kernel import _compat


def test_compatible_release_range_accepts_and_refuses():
    _compat.check_pin("fpv2-index", "0.1.0", "fpv2-kernel~=0.1", "0.1.7")
    _compat.check_pin("fpv2-index", "0.1.0", "fpv2-kernel~=0.1", "0.9.0")
    with pytest.raises(
        _compat.IncompatibleSiblingError,
        match=r"fpv2-index 0.1.0 requires fpv2-kernel~=0.1, but fpv2-kernel 1.0.0 is installed",
    ):
        _compat.check_pin("fpv2-index", "0.1.0", "fpv2-kernel~=0.1", "1.0.0")
    with pytest.raises(_compat.IncompatibleSiblingError, match="0.0.9 is installed"):
        _compat.check_pin("fpv2-index", "0.1.0", "fpv2-kernel~=0.1", "0.0.9")


def test_missing_metadata_passes():
    _compat.check_pin("fpv2-index", "0.1.0", "fpv2-kernel~=0.1", None)


class FakeDist:
    version = "0.1.0"
    requires = ("fpv2-kernel~=0.1", "packaging>=23", "fpv2-index~=0.1; extra == 'x'")


def test_check_siblings_reads_installed_metadata(monkeypatch):
    monkeypatch.setattr(metadata, "distribution", lambda name: FakeDist())
    versions = {"fpv2-kernel": "2.0.0", "fpv2-index": "5.0.0"}
    monkeypatch.setattr(metadata, "version", lambda name: versions[name])
    with pytest.raises(_compat.IncompatibleSiblingError, match="fpv2-kernel 2.0.0 is installed"):
        _compat.check_siblings("fpv2-correction")
    versions["fpv2-kernel"] = "0.1.3"  # the marker-guarded extra is not checked
    _compat.check_siblings("fpv2-correction")


def test_check_siblings_without_distribution_is_silent(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    _compat.check_siblings("fpv2-serving")
