"""Every development task of the fpv2 monorepo: ``nox -l`` lists them.

The sessions install the four component wheels from ``packages/`` the way a
user would (real wheels, the kernel's native library built with nvcc when
one is found), so the tests exercise what ships.
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import nox

nox.options.sessions = ["lint", "tests", "docs"]
nox.options.default_venv_backend = "venv"

PACKAGES = [f"./packages/fpv2-{name}" for name in ("kernel", "index", "correction", "serving")]
# The CPU machines carry these as local files; elsewhere pip takes them from the index.
TORCH = os.environ.get("FPV2_TORCH_SPEC", "torch==2.13.0")
TRITON = os.environ.get("FPV2_TRITON_SPEC", "triton==3.6.0")
BUILD_REQUIREMENTS = ["scikit-build-core>=0.10", "nvidia-cutlass==4.2.0.0", "cmake>=3.26", "ninja"]
WHEEL_DIR = "dist"
# The output of the last wheel build (``_build_wheels``), and where the kernel wheel's CMake build lives
# (``build-dir`` in packages/fpv2-kernel/pyproject.toml: it persists, so its test programs can be reused).
BUILD_LOG = os.path.join(WHEEL_DIR, "build.log")
KERNEL_BUILD_DIRS = "packages/fpv2-kernel/build/*/"
TEST_REQUIREMENTS = ["pytest>=8", "hypothesis>=6", "numpy", "tqdm", "rich", "matplotlib", "packaging"]


def _build_wheels(session: nox.Session) -> list[str]:
    """Build the four wheels into ``dist/`` (no build isolation: one CUTLASS pin) and return their paths.

    The kernel wheel compiles its native library here (about 6 minutes on 2 cores), so every session
    that needs the project installs these files rather than building again.
    """
    shutil.rmtree(WHEEL_DIR, ignore_errors=True)
    # -v keeps the build's output (ptxas's register and spill report among it) for ``nox -s native -- --reuse``,
    # which checks the library and test programs this build made instead of compiling them again.
    log = session.run(
        "python", "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps", "-w", WHEEL_DIR, *PACKAGES,
        silent=True,
    )  # fmt: skip
    with open(BUILD_LOG, "w", encoding="utf-8") as out:
        out.write(log or "")
    session.log(f"build output: {BUILD_LOG}")
    return _built_wheels(session)


def _built_wheels(session: nox.Session) -> list[str]:
    """The wheels in ``dist/``: exactly one per package, at the version its ``_version.py`` names."""
    wheels = sorted(glob.glob(os.path.join(WHEEL_DIR, "*.whl")))
    expected = sorted(f"{name}-{version}-" for name, version in _package_versions().items())
    found = sorted("-".join(os.path.basename(wheel).split("-")[:2]) + "-" for wheel in wheels)
    if found != expected:
        session.error(f"expected wheels {expected} in {WHEEL_DIR}/, found {[os.path.basename(w) for w in wheels]}")
    session.log("wheels: " + ", ".join(os.path.basename(w) for w in wheels))
    return wheels


def _package_versions() -> dict[str, str]:
    """``{"fpv2_kernel": "0.1.5", ...}`` read from each package's ``_version.py`` (wheel name spelling)."""
    versions = {}
    for package in PACKAGES:
        component = package.rsplit("-", 1)[1]
        with open(os.path.join(package, "src", "fpv2", component, "_version.py"), encoding="utf-8") as source:
            versions[f"fpv2_{component}"] = re.search(r'__version__ = "([^"]+)"', source.read()).group(1)
    return versions


def _install_project(session: nox.Session) -> None:
    """Install torch, the build backend and the four wheels, built once into ``dist/``."""
    session.install(TORCH, TRITON)
    session.install(*BUILD_REQUIREMENTS, *TEST_REQUIREMENTS)
    session.install("--no-deps", *_build_wheels(session))


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
    the device through ``scripts/hopper_check.sh``. ``nox -s native -- --reuse`` compiles nothing:
    it runs the same checks on the kernel wheel's build from an earlier ``tests`` or ``build`` session.
    """
    if shutil.which("nvcc") is None:
        session.skip("nvcc not found")
    if "--reuse" in session.posargs:
        _native_checks_of_wheel_build(session)
        return
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


def _native_checks_of_wheel_build(session: nox.Session) -> None:
    """The ``native`` checks on what the last wheel build compiled (``nox -s native -- --reuse``, used by CI).

    The kernel wheel's CMake build makes the library and both test programs (FPV2_BUILD_HOPPER_KERNEL is on
    by default), so compiling them again here would repeat its 6-10 minutes. Its ptxas report must be in
    ``dist/build.log``: an incremental build recompiles nothing and reports nothing, so that is refused.
    """
    checker = "fpv2_hopper_layout_check"
    build_dirs = [d for d in glob.glob(KERNEL_BUILD_DIRS) if os.path.isfile(os.path.join(d, checker))]
    if len(build_dirs) != 1 or not os.path.isfile(BUILD_LOG):
        session.error(
            f"--reuse needs one kernel wheel build with its test programs ({KERNEL_BUILD_DIRS}, found {build_dirs}) "
            f"and its output {BUILD_LOG}: run `nox -s tests` (or `nox -s build`) first"
        )
    build_dir = build_dirs[0]
    session.log(f"reusing the kernel wheel's build in {build_dir} and its output {BUILD_LOG}")
    session.run("python", "packages/fpv2-kernel/tools/check_ptxas_report.py", BUILD_LOG)
    session.run(os.path.join(build_dir, checker), external=True)
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
    """The four wheels into ``dist/`` (the kernel wheel compiles its native library when nvcc is found).

    ``nox -s build -- --reuse`` builds nothing: it checks the wheels an earlier session of this
    checkout (``tests``, ``demo``) left in ``dist/``, one per package at its current version. CI uses it
    so the native library compiles once.
    """
    if "--reuse" in session.posargs:
        _built_wheels(session)
        return
    session.install(*BUILD_REQUIREMENTS, "pip")
    _build_wheels(session)


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
