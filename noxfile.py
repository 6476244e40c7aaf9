"""Every development task of the fpv2 monorepo: ``nox -l`` lists them.

The sessions install the four component wheels from ``packages/`` the way a
user would (real wheels, the kernel's native library built with nvcc when
one is found), so the tests exercise what ships.
"""

from __future__ import annotations

import glob
import os
import shutil

import nox

nox.options.sessions = ["lint", "tests", "docs"]
nox.options.default_venv_backend = "venv"

PACKAGES = [f"./packages/fpv2-{name}" for name in ("kernel", "index", "correction", "serving")]
# The CPU machines carry these as local files; elsewhere pip takes them from the index.
TORCH = os.environ.get("FPV2_TORCH_SPEC", "torch==2.13.0")
TRITON = os.environ.get("FPV2_TRITON_SPEC", "triton==3.6.0")
BUILD_REQUIREMENTS = ["scikit-build-core>=0.10", "nvidia-cutlass==4.2.0.0", "cmake>=3.26", "ninja"]
TEST_REQUIREMENTS = ["pytest>=8", "hypothesis>=6", "numpy", "tqdm", "rich", "matplotlib", "packaging"]


def _install_project(session: nox.Session) -> None:
    """Install torch, the build backend and the four wheels (no build isolation: one CUTLASS pin)."""
    session.install(TORCH, TRITON)
    session.install(*BUILD_REQUIREMENTS, *TEST_REQUIREMENTS)
    session.install("--no-build-isolation", "--no-deps", *PACKAGES)


def _native_expected() -> bool:
    return shutil.which("nvcc") is not None and os.environ.get("FPV2_BUILD_NATIVE", "AUTO").upper() != "OFF"


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite; GPU-marked tests skip without CUDA. ``nox -s tests -- -k name`` passes pytest options."""
    session.install(TORCH, TRITON)
    # The real engine interfaces (SGLang, vLLM, transformers) for the adapter tests, pinned, without
    # letting pip swap the CPU torch for another build.
    session.install("--no-deps", "-r", "packages/fpv2-serving/requirements-engines.txt")
    _install_project(session)
    # Without a GPU the Triton kernels run (and are tested) under the interpreter.
    env = {"TRITON_INTERPRET": "1"} if shutil.which("nvidia-smi") is None else {}
    env["HF_HUB_OFFLINE"] = "1"  # tests build their tiny models locally; nothing is downloaded
    if _native_expected():
        # nvcc is here, so the kernel wheel must have built its library: its tests may not skip.
        env["FPV2_REQUIRE_NATIVE"] = "1"
        library = session.run(
            "python", "-c", "from fpv2.kernel._native import library_path; print(library_path())", silent=True
        ).strip()
        session.run("python", "packages/fpv2-kernel/tools/check_symbols.py", library, env=env)
    # One pytest per wheel: each tests/ folder is its own rootdir-relative import root.
    for package in PACKAGES:
        session.run(
            "python",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            f"{package}/tests",
            *session.posargs,
            env=env,
            success_codes=[0, 5],  # 5 = nothing collected (e.g. a -k filter that matches nothing)
        )


@nox.session
def native(session: nox.Session) -> None:
    """Build the sm_90a Hopper kernel and its test programs; run their host-only checks.

    Needs nvcc (no GPU): keeps the CuTe kernel compiling, checks the fragment and tile
    algebra (``fpv2_hopper_layout_check``) and the launcher's refusals. Its GPU modes run on
    the device through ``scripts/hopper_check.sh``.
    """
    if shutil.which("nvcc") is None:
        session.skip("nvcc not found")
    session.install(*BUILD_REQUIREMENTS)
    cutlass = session.run(
        "python",
        "-c",
        "import importlib.util as u, os; "
        "print(os.path.join(u.find_spec('cutlass_library').submodule_search_locations[0], 'source', 'include'))",
        silent=True,
    ).strip()
    build_dir = os.path.join(session.create_tmp(), "hopper-build")
    session.run(
        "cmake", "-S", "packages/fpv2-kernel", "-B", build_dir, "-G", "Ninja",
        "-DFPV2_BUILD_HOPPER_KERNEL=ON", f"-DFPV2_CUTLASS_DIR={cutlass}",
    )  # fmt: skip
    # -v prints ptxas's report; a kernel that ptxas moved to local memory fails here, not on the device.
    build_log = session.run("cmake", "--build", build_dir, "-v", "-j", str(os.cpu_count() or 2), silent=True)
    log_path = os.path.join(session.create_tmp(), "hopper-build.log")
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(build_log or "")
    # An incremental build that did not recompile the kernel prints no report: nothing to check then.
    session.run("python", "packages/fpv2-kernel/tools/check_ptxas_report.py", log_path, "--allow-missing")
    session.run(os.path.join(build_dir, "fpv2_hopper_layout_check"), external=True)
    session.run(os.path.join(build_dir, "fpv2_hopper_prefill_test"), "--mode", "refusals", external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def docs(session: nox.Session) -> None:
    """Sphinx HTML docs with warnings as errors."""
    session.install(TORCH, "-r", "docs/requirements.txt", "packaging", "numpy")
    shutil.rmtree("docs/_build", ignore_errors=True)
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


@nox.session
def build(session: nox.Session) -> None:
    """The four wheels into ``dist/`` (the kernel wheel compiles its native library when nvcc is found)."""
    session.install(*BUILD_REQUIREMENTS, "pip")
    shutil.rmtree("dist", ignore_errors=True)
    session.run("python", "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", "dist", *PACKAGES)
    wheels = sorted(glob.glob("dist/*.whl"))
    session.log("built: " + ", ".join(os.path.basename(w) for w in wheels))
    if len(wheels) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels, got {wheels}")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: ``fpv2 info`` then ``fpv2 bench`` (CPU reference path on a small input without a GPU)."""
    _install_project(session)
    session.run("fpv2", "info")
    session.run("fpv2", "bench", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """``fpv2 bench`` with explicit arguments, e.g. ``nox -s bench -- -L 32768 --dtype bf16``."""
    _install_project(session)
    session.run("fpv2", "bench", *session.posargs)
