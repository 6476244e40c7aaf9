"""Test-wide setup of the index package's suite.

The index's scoring pass defaults to the Hopper kernel wherever it serves the call
(``FPV2_INDEX_SCORING=auto``). The ``test_triton_*`` modules and the workspace
stream tests exercise the fused Triton pass itself (its workspace, completion
counter, relaunches and variants), which non-Hopper GPUs run: on an sm_90 GPU they
would silently test the Hopper kernel instead. They run with
``FPV2_INDEX_SCORING=triton`` unless the environment names a mode (a device run
that sets ``auto`` puts the Hopper kernel through the same suite on purpose).
"""

from __future__ import annotations

import os

import pytest

#: Environment variable of the scoring pass (``fpv2.index.triton.hopper_scoring.SCORING_ENV``; not imported,
#: so that collecting the suite does not import Triton).
_SCORING_ENV = "FPV2_INDEX_SCORING"
_TRITON_PASS_MODULES = ("test_triton_", "test_index_workspace_streams")


@pytest.fixture(autouse=True)
def _triton_pass_for_its_own_tests(request, monkeypatch) -> None:
    module = request.module.__name__.rpartition(".")[2]
    if module.startswith(_TRITON_PASS_MODULES) and _SCORING_ENV not in os.environ:
        monkeypatch.setenv(_SCORING_ENV, "triton")
