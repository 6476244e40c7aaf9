"""Does a sparse pipeline timing depend on what ran before it? (GPU power state across benchmark rows.)

``fpv2 bench`` times the corrected sparse pipeline right after the dense baselines, which hold the H200 at its
power cap (about 690 W, SM clock 1500-1700 MHz, throttle reason "software power cap" in ``nvidia-smi``); its three
warm-up calls of the pipeline last tens of milliseconds, while the board's power average takes about a second to
fall. This probe times the same pipeline (planted bf16 workload, 32/8 heads, d = 128, page 1, alpha 0.1, the
default backend) in three GPU states, twice each in the order A B C A B C:

- ``after-dense``: right after at least 3 s of the backend's dense mode (what the bench does today);
- ``after-idle``: after 3 s with the GPU idle;
- ``own-warm``: after at least 1.5 s of the pipeline's own calls (its steady state, as inside a model's forward).

Each state: eager and host-ahead medians of ``--repeats`` calls after 3 warm-up calls (the bench's measurement),
and the SM clock and power read before and after (NVML through torch, else ``nvidia-smi``).

Usage (the packages' ``src`` on ``PYTHONPATH``, on a GPU): ``python benchmarks/clock_state_probe.py --out probe.json``
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from functools import partial

import torch
from shape_rows import shape_main

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import DENSE_STRATEGY, SparsePrefillPipeline
from fpv2.serving.timing import host_ahead_samples, median, timed_samples

STATES = ("after-dense", "after-idle", "own-warm")


def gpu_state(device: torch.device) -> dict[str, float | None]:
    """SM clock (MHz) and power draw (W) now."""
    try:
        return {"sm_mhz": float(torch.cuda.clock_rate(device)), "watts": torch.cuda.power_draw(device) / 1000.0}
    except Exception:  # no NVML binding: ask nvidia-smi
        query = ["nvidia-smi", f"--id={device.index or 0}", "--query-gpu=clocks.sm,power.draw"]
        text = subprocess.run([*query, "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
        try:
            mhz, watts = (float(x) for x in text.strip().split(","))
        except ValueError:
            return {"sm_mhz": None, "watts": None}
        return {"sm_mhz": mhz, "watts": watts}


def run_for(call: Callable[[], object], seconds: float, device: torch.device) -> int:
    """Repeat ``call`` until ``seconds`` have passed (synchronised every call); the number of calls."""
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        call()
        torch.cuda.synchronize(device)
        calls += 1
    return calls


def row(batch: int, length: int, repeats: int, alpha: float, device: torch.device) -> dict:
    w = planted_workload([length] * batch, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=1, device=device)
    sparse = partial(SparsePrefillPipeline(SelectionConfig(alpha=alpha)), w.q, w.k_cache, w.v_cache, w.batch)
    dense_pipe = SparsePrefillPipeline(SelectionConfig(alpha=alpha), strategy=DENSE_STRATEGY, correction=False)
    dense = partial(dense_pipe, w.q, w.k_cache, w.v_cache, w.batch)
    dense()
    sparse()
    torch.cuda.synchronize(device)
    measured: dict[str, list[dict]] = {s: [] for s in STATES}
    for state in STATES * 2:
        if state == "after-dense":
            prior = {"dense_calls": run_for(dense, 3.0, device)}
        elif state == "after-idle":
            time.sleep(3.0)
            prior = {"idle_s": 3.0}
        else:
            prior = {"own_calls": run_for(sparse, 1.5, device)}
        before = gpu_state(device)
        samples, _ = timed_samples(sparse, 3, repeats, device)
        middle = gpu_state(device)
        gpu, _ = host_ahead_samples(sparse, repeats, device)
        measured[state].append(
            {
                **prior,
                "eager_ms": round(median(samples), 3),
                "eager_samples_ms": [round(s, 3) for s in samples],
                "host_ahead_ms": round(median(gpu), 3) if gpu else None,
                "gpu_before": before,
                "gpu_after_eager": middle,
                "gpu_after": gpu_state(device),
            }
        )
    return {"B": batch, "L": length, "alpha": alpha, "repeats": repeats, "states": measured}


def summary(r: dict) -> str:
    parts = []
    for state, runs in r["states"].items():
        eager = " / ".join(f"{x['eager_ms']:.2f}" for x in runs)
        ahead = " / ".join(f"{x['host_ahead_ms']:.2f}" if x["host_ahead_ms"] else "-" for x in runs)
        clocks = " / ".join(f"{x['gpu_before']['sm_mhz']}" for x in runs)
        parts.append(f"  {state}: eager {eager}, host-ahead {ahead} ms; SM clock at start {clocks} MHz")
    return f"{r['B']}x{r['L']}:\n" + "\n".join(parts)


if __name__ == "__main__":
    shape_main(__doc__.splitlines()[0], row, summary)
