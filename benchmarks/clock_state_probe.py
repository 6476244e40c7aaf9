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
and the SM clock and power read before and after (:func:`fpv2.serving.environment.gpu_clock_state`).

Usage (the packages' ``src`` on ``PYTHONPATH``, on a GPU): ``python benchmarks/clock_state_probe.py --out probe.json``
"""

from __future__ import annotations

import time
from functools import partial

import torch
from shape_rows import shape_main

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.environment import gpu_clock_state
from fpv2.serving.pipeline import DENSE_STRATEGY, SparsePrefillPipeline
from fpv2.serving.timing import host_ahead_samples, median, timed_samples, warm_for

STATES = ("after-dense", "after-idle", "own-warm")


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
            prior = {"dense_calls": warm_for(dense, 3000.0, device)}
        elif state == "after-idle":
            time.sleep(3.0)
            prior = {"idle_s": 3.0}
        else:
            prior = {"own_calls": warm_for(sparse, 1500.0, device)}
        before = gpu_clock_state(device)
        samples, _ = timed_samples(sparse, 3, repeats, device)
        middle = gpu_clock_state(device)
        gpu, _ = host_ahead_samples(sparse, repeats, device)
        measured[state].append(
            {
                **prior,
                "eager_ms": round(median(samples), 3),
                "eager_samples_ms": [round(s, 3) for s in samples],
                "host_ahead_ms": round(median(gpu), 3) if gpu else None,
                "gpu_before": before,
                "gpu_after_eager": middle,
                "gpu_after": gpu_clock_state(device),
            }
        )
    return {"B": batch, "L": length, "alpha": alpha, "repeats": repeats, "states": measured}


def summary(r: dict) -> str:
    parts = []
    for state, runs in r["states"].items():
        eager = " / ".join(f"{x['eager_ms']:.2f}" for x in runs)
        ahead = " / ".join(f"{x['host_ahead_ms']:.2f}" if x["host_ahead_ms"] else "-" for x in runs)
        clocks = " / ".join(str((x["gpu_before"] or {}).get("sm_mhz")) for x in runs)
        parts.append(f"  {state}: eager {eager}, host-ahead {ahead} ms; SM clock at start {clocks} MHz")
    return f"{r['B']}x{r['L']}:\n" + "\n".join(parts)


if __name__ == "__main__":
    shape_main(__doc__.splitlines()[0], row, summary)
