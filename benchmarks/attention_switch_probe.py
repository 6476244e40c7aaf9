"""The Hopper attention kernel alone under the settings of launcher switches, interleaved in one process.

Builds the planted workload (``--drift-tokens`` for the drifting background), runs the pipeline once per
correction mode (off, the mean shift, the second-order shift) on the Hopper backend, keeps the attention
launch's arguments, then replays only that launch: per sample ``--calls`` launches back to back between two CUDA
events (the host issues ahead, so the GPU time is the kernel's), the settings of the environment switch
``--switch`` (the launcher reads its ``FPV2_HOPPER_*`` switches at every launch) alternating within each round.
``--env-sets`` alternates sets of several switches instead (e.g. persistent CTAs together with the work order).
Prints one JSON line per mode: the median milliseconds per launch of each setting, their spread, and the largest
output difference between the settings. To compare two libraries, run it once per library
(``FPV2_KERNEL_LIBRARY``) with one setting, in alternating processes.

Usage (the four packages' ``src`` on ``PYTHONPATH``, ``FPV2_KERNEL_LIBRARY`` set, on an sm90 GPU):
``python benchmarks/attention_switch_probe.py --switch FPV2_HOPPER_HEAD_MAJOR --settings 1,0 --seqlen 131072``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch
from shift_cost_probe import MODES  # this folder, first on sys.path when run as a script

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline


def recorded_backend_calls(backend, fn: Callable[[], object]) -> tuple[object, list[tuple[Callable, tuple, dict]]]:
    """Runs ``fn`` with ``backend.run`` recorded; returns its result and every call as (run, args, kwargs)."""
    run = backend.run
    calls: list[tuple[Callable, tuple, dict]] = []

    def recording_run(*args, **kwargs):
        calls.append((run, args, kwargs))
        return run(*args, **kwargs)

    backend.run = recording_run
    try:
        result = fn()
    finally:
        backend.run = run
    return result, calls


def recorded_attention_call(pipe: SparsePrefillPipeline, workload) -> tuple[Callable, tuple, dict]:
    """Runs ``pipe`` once on ``workload``; returns its backend's ``run`` and the arguments of its attention call."""
    _, calls = recorded_backend_calls(pipe.backend, lambda: pipe(workload.q, workload.k_cache, workload.v_cache,
                                                                  workload.batch))  # fmt: skip
    return calls[-1]


def captured_launch(pipe: SparsePrefillPipeline, workload):
    """Runs ``pipe`` once and returns a function that replays its attention launch (same index, plan, copies)."""
    run, args, kwargs = recorded_attention_call(pipe, workload)
    return lambda: run(*args, **kwargs)


def timed(launch, calls: int) -> float:
    """Milliseconds per launch of ``calls`` launches issued back to back between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def parse_env_sets(sets: list[str]) -> dict[str, dict[str, str]]:
    """``{set: {variable: value}}`` of ``--env-sets`` entries ``VAR=value:VAR2=value``."""
    parsed = {}
    for entry in sets:
        pairs = [part.split("=", 1) for part in entry.split(":")]
        if any(len(pair) != 2 or not pair[0] for pair in pairs):
            raise SystemExit(f"--env-sets entry {entry!r}: expected VAR=value[:VAR=value...]")
        parsed[entry] = dict(pairs)
    return parsed


def apply_env(env: dict[str, str], names: list[str]) -> None:
    """Set the variables of ``env`` and unset the other ``names``."""
    for name in names:
        if name in env:
            os.environ[name] = env[name]
        else:
            os.environ.pop(name, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefix", type=int, default=0, help="cached KV tokens before each request's queries")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--backend", default="hopper", help="attention backend of the pipeline (hopper, triton)")
    parser.add_argument(
        "--dense-tail-tiles", type=int, default=None, help="SelectionConfig.dense_tail_tiles (default: its default)"
    )
    parser.add_argument("--drift-tokens", type=float, default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=5, help="launches per timed sample")
    parser.add_argument("--switch", help="the environment variable to set, e.g. FPV2_HOPPER_HEAD_MAJOR")
    parser.add_argument("--settings", default="0,1", help="its values to alternate, comma-separated")
    parser.add_argument(
        "--env-sets",
        nargs="+",
        help="instead of --switch: settings of several variables each, e.g. 'FPV2_HOPPER_PERSISTENT=0' "
        "'FPV2_HOPPER_PERSISTENT=dynamic:FPV2_HOPPER_WORK_ORDER=1' (a variable a set leaves out is unset)",
    )
    parser.add_argument("--modes", default="off,mean,second_order")
    parser.add_argument("--label", default="", help="a name for the library under test, copied into the JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_switch_probe needs a CUDA GPU (the Hopper backend)")
    if (args.switch is None) == (args.env_sets is None):
        parser.error("give --switch (with --settings) or --env-sets")
    if args.env_sets:
        env_sets = parse_env_sets(args.env_sets)
    else:
        env_sets = {setting: {args.switch: setting} for setting in args.settings.split(",")}
    settings = list(env_sets)
    names = sorted({name for env in env_sets.values() for name in env})
    previous = {name: os.environ.get(name) for name in names}
    shape = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": args.page_size}
    seqlens_q, seqlens_k = [args.seqlen] * args.batch, [args.prefix + args.seqlen] * args.batch
    wl = planted_workload(seqlens_q, seqlens_k, **shape, dtype=torch.bfloat16, device=torch.device("cuda"),
                          drift_tokens=args.drift_tokens)  # fmt: skip
    tail = {} if args.dense_tail_tiles is None else {"dense_tail_tiles": args.dense_tail_tiles}
    config = SelectionConfig(alpha=args.alpha, **tail)
    wanted = args.modes.split(",")
    for label, correction, shift in MODES:
        if label not in wanted:
            continue
        pipe = SparsePrefillPipeline(config, correction=correction, mass_shift=shift, backend=args.backend)
        launch = captured_launch(pipe, wl)
        outputs = {}
        for setting in settings:  # warm-up, and each setting's output for the comparison
            apply_env(env_sets[setting], names)
            outputs[setting] = launch().float()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {s: [] for s in settings}
        for _ in range(args.rounds):
            for setting in settings:
                apply_env(env_sets[setting], names)
                times[setting].append(timed(launch, args.calls))
        first = outputs[settings[0]]
        differences = {s: (outputs[s] - first).abs().max().item() for s in settings[1:]}
        print(json.dumps({
            "label": args.label, "switch": args.switch or "+".join(names), "mode": label, "seqlen": args.seqlen,
            "batch": args.batch, "prefix": args.prefix, "backend": args.backend,
            "page_size": args.page_size, "drift_tokens": args.drift_tokens, "alpha": args.alpha,
            "dense_tail_tiles": config.dense_tail_tiles,
            "rounds": args.rounds, "calls": args.calls,
            "median_ms": {s: round(statistics.median(t), 4) for s, t in times.items()},
            "min_ms": {s: round(min(t), 4) for s, t in times.items()},
            "max_ms": {s: round(max(t), 4) for s, t in times.items()},
            f"max_abs_difference_vs_{settings[0]}": differences,
        }), flush=True)  # fmt: skip
    # The library reads the switches at every launch: put back what the caller had.
    apply_env({name: value for name, value in previous.items() if value is not None}, names)


if __name__ == "__main__":
    main()
