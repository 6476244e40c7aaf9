"""One Hopper attention call per correction mode, for a profiler, or timed: where the pooled tiles' time goes.

Builds the planted workload (``--drift-tokens`` for the drifting background), warms one pipeline per mode
(correction off, the mean shift, the second-order shift) on the Hopper backend, then runs one call of each
between ``cudaProfilerStart`` / ``cudaProfilerStop``, in that order. Under ``ncu --profile-from-start off
--kernel-name regex:prefill_kernel`` the three attention kernels are the only ones profiled, so their counters
differ by the correction's work alone (same index, same kept blocks). With ``--repeats N`` it times instead: the
median GPU time (CUDA events) of N whole calls per mode, rounds of the three modes interleaved, printed as one JSON
line (for A/B runs of two libraries through ``FPV2_KERNEL_LIBRARY``).

Usage (the four packages' ``src`` on ``PYTHONPATH``, on an sm90 GPU):
``ncu --profile-from-start off --kernel-name regex:prefill_kernel --section ... python benchmarks/shift_cost_probe.py``
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving.pipeline import SparsePrefillPipeline

#: The modes in their profiled order: (label, correction, mass shift).
MODES = (("off", False, "mean"), ("mean", True, "mean"), ("second_order", True, "second_order"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=0.1)
    parser.add_argument("--drift-tokens", type=float, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=0, help="time N calls per mode instead of profiling one")
    parser.add_argument("--label", default="", help="a name for the library under test, copied into the JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("shift_cost_probe needs a CUDA GPU (the Hopper backend)")
    shape = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": args.page_size}
    wl = planted_workload([args.seqlen], **shape, dtype=torch.bfloat16, device=torch.device("cuda"),
                          drift_tokens=args.drift_tokens)  # fmt: skip
    config = SelectionConfig(alpha=args.alpha)
    pipes = [
        (label, SparsePrefillPipeline(config, correction=corr, mass_shift=shift, backend="hopper"))
        for label, corr, shift in MODES
    ]
    for _, pipe in pipes:
        for _ in range(args.warmup):
            pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    torch.cuda.synchronize()
    if args.repeats > 0:
        times: dict[str, list[float]] = {label: [] for label, _ in pipes}
        for _ in range(args.repeats):
            for label, pipe in pipes:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
                end.record()
                end.synchronize()
                times[label].append(start.elapsed_time(end))
        medians = {label: round(statistics.median(ms), 4) for label, ms in times.items()}
        print(json.dumps({"label": args.label, "seqlen": args.seqlen, "drift_tokens": args.drift_tokens,
                          "alpha": args.alpha, "repeats": args.repeats, "median_ms": medians}))  # fmt: skip
        return
    torch.cuda.cudart().cudaProfilerStart()
    for label, pipe in pipes:
        pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
        torch.cuda.synchronize()
        print(f"profiled: {label}")
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
