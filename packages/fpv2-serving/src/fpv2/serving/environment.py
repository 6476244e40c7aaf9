"""What is installed and where we run: wheel versions, native library, torch/triton, GPU, git commit.

Used by ``fpv2 info`` and recorded in every benchmark results file. Each probe
reports a problem as text instead of raising, so a broken sibling still shows
up in the listing next to the parts that work.
"""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

#: The four fpv2 wheels and the module each one provides.
COMPONENTS = {
    "fpv2-kernel": "fpv2.kernel",
    "fpv2-index": "fpv2.index",
    "fpv2-correction": "fpv2.correction",
    "fpv2-serving": "fpv2.serving",
}


def component_version(dist: str) -> str:
    """Version of one fpv2 wheel: the imported module's, and the installed metadata's when they differ.

    Args:
        dist: distribution name, a key of :data:`COMPONENTS`.

    Returns:
        e.g. ``"0.1.0"``, ``"0.1.0 (source tree)"`` or ``"not importable (...)"``.
    """
    module = COMPONENTS[dist]
    try:
        installed: str | None = metadata.version(dist)
    except metadata.PackageNotFoundError:
        installed = None
    try:
        running = importlib.import_module(f"{module}._version").__version__
    except Exception as exc:
        return f"not importable ({type(exc).__name__}: {exc})"
    if installed is None:
        return f"{running} (source tree)"
    if installed != running:
        return f"{running} (imported; installed wheel metadata says {installed})"
    return running


def component_versions() -> dict[str, str]:
    """Versions of all four fpv2 wheels (see :func:`component_version`).

    Returns:
        ``{distribution: version text}``.
    """
    return {dist: component_version(dist) for dist in COMPONENTS}


def native_library_status() -> str:
    """The C ABI version of the loaded native library, or why it is not loaded.

    Returns:
        A one-line description.
    """
    try:
        from fpv2.kernel import _native
    except Exception as exc:
        return f"not loaded: fpv2.kernel._native cannot be imported ({type(exc).__name__}: {exc})"
    try:
        ok, reason = _native.native_status()
        if not ok:
            return f"not loaded: {reason}"
        major, minor = _native.abi_version()
    except Exception as exc:
        return f"not loaded: {type(exc).__name__}: {exc}"
    return f"C ABI {major}.{minor} ({reason})"


def triton_version() -> str:
    """Installed Triton version, or ``"not installed"``.

    Returns:
        The version text.
    """
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "not installed"


def gpu_descriptions() -> list[str]:
    """One line per visible CUDA device (name and compute capability); empty without a GPU.

    Returns:
        e.g. ``["cuda:0 NVIDIA H200 (sm_90, 139.8 GiB)"]``.
    """
    if not torch.cuda.is_available():
        return []
    lines = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i} {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB)")
    return lines


def gpu_name(device: torch.device) -> str:
    """Short name of the device a benchmark ran on (``"cpu"`` for the host).

    Args:
        device: the benchmark device.

    Returns:
        The GPU name, or ``"cpu"``.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def gpu_clock_state(device: torch.device) -> dict[str, object] | None:
    """The device's SM clock and power draw now, for a benchmark row's record; None off CUDA or unreadable.

    Read through NVML (``torch.cuda.clock_rate`` and ``power_draw``, which need the ``nvidia-ml-py`` binding),
    else through ``nvidia-smi`` when ``CUDA_VISIBLE_DEVICES`` does not renumber the devices. An H200 at its power
    cap runs its SM clock at 1500-1700 MHz instead of 1980, and keeps it there for about a second after the load
    that caused it: a timing is read with the clock it ran at.

    Args:
        device: the benchmark device.

    Returns:
        ``{"sm_mhz": float, "watts": float, "source": "nvml" | "nvidia-smi"}``, or None.
    """
    if device.type != "cuda":
        return None
    try:
        return {
            "sm_mhz": float(torch.cuda.clock_rate(device)),
            "watts": round(torch.cuda.power_draw(device) / 1000.0, 1),  # NVML reports milliwatts
            "source": "nvml",
        }
    except Exception:  # no NVML binding (ModuleNotFoundError) or an NVML error: try the command line
        pass
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return None  # nvidia-smi numbers the devices of the whole machine
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        text = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        mhz, watts = (float(x) for x in text.strip().split(","))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return {"sm_mhz": mhz, "watts": watts, "source": "nvidia-smi"}


def selection_strategies() -> str:
    """Comma-separated selection strategies of ``fpv2.index``, or why they cannot be listed.

    Returns:
        The strategies text.
    """
    try:
        from fpv2.index import available_strategies

        return ", ".join(available_strategies())
    except Exception as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"


def index_scoring() -> str:
    """Which scoring pass the index's selection takes on this machine (``$FPV2_INDEX_SCORING``), and why.

    Returns:
        The mode and, for ``auto``, whether the Hopper kernel runs on the current device (the dtype, head dim
        and length of a call still decide) or why not.
    """
    try:
        from fpv2.index.triton.hopper_scoring import SCORING_ENV, device_scoring_reason, scoring_mode

        mode = scoring_mode()
        if mode == "triton":
            return f"triton ({SCORING_ENV}): the fused Triton pass"
        reason = device_scoring_reason()
    except Exception as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"
    if reason is None:
        rest = ", the fused Triton pass for the rest" if mode == "auto" else ""
        return f"{mode} ({SCORING_ENV}): the Hopper wgmma kernel for bf16 / fp16 calls at head dims 64 and 128{rest}"
    if mode == "hopper":
        return f"hopper ({SCORING_ENV}): calls will be refused here ({reason})"
    return f"auto ({SCORING_ENV}): the fused Triton pass here ({reason})"


def backend_lines() -> list[str]:
    """One line per registered attention backend: name, available or not, reason.

    Returns:
        The lines.
    """
    from .backends import backend_status

    return [f"{name}: {'available' if ok else 'unavailable'} ({why})" for name, (ok, why) in backend_status().items()]


def git_commit() -> str:
    """Commit of the checkout being run (``FPV2_COMMIT`` overrides), ``-dirty`` when modified.

    Returns:
        The commit hash, or ``"unknown"`` outside a git checkout.
    """
    if os.environ.get("FPV2_COMMIT"):
        return os.environ["FPV2_COMMIT"]
    for where in (Path.cwd(), Path(__file__).resolve().parent):
        try:
            head = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=where,
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if head:
            return head + ("-dirty" if dirty else "")
    return "unknown"


def machine_info() -> dict[str, object]:
    """Host description for results files.

    Returns:
        Hostname, platform, processor, CPU count and Python version.
    """
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def environment_record() -> dict[str, object]:
    """Everything a results file records about the software and hardware.

    Returns:
        A JSON-serialisable dict.
    """
    return {
        "machine": machine_info(),
        "gpus": gpu_descriptions(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version(),
        "wheels": component_versions(),
        "native_library": native_library_status(),
        "index_scoring": index_scoring(),
        "commit": git_commit(),
    }


def info_lines() -> list[str]:
    """The report printed by ``fpv2 info``.

    Returns:
        The lines, without trailing newlines.
    """
    lines = ["fpv2 components:"]
    lines += [f"  {dist:<16} {version}" for dist, version in component_versions().items()]
    lines.append(f"native library:   {native_library_status()}")
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)"
    lines.append(f"torch:            {torch.__version__}{cuda}")
    lines.append(f"triton:           {triton_version()}")
    gpus = gpu_descriptions()
    lines.append("GPU:              " + ("; ".join(gpus) if gpus else "no GPU"))
    lines.append("attention backends:")
    try:
        lines += [f"  {line}" for line in backend_lines()]
    except Exception as exc:
        lines.append(f"  unavailable ({type(exc).__name__}: {exc})")
    lines.append(f"selection strategies: {selection_strategies()}")
    lines.append(f"index scoring:    {index_scoring()}")
    return lines
