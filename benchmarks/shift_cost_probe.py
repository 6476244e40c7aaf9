"""One Hopper attention call per correction mode, for a profiler: where the pooled tiles' time goes.

Builds the planted workload (``--drift-tokens`` for the drifting background), warms one pipeline per mode
(correction off, the mean shift, the second-order shift) on the Hopper backend, then runs one call of each
between ``cudaProfilerStart`` / ``cudaProfilerStop``, in that order. Under ``ncu --profile-from-start off
--kernel-name regex:prefill_kernel`` the three attention kernels are the only ones profiled, so their counters
differ by the correction's work alone (same index, same kept blocks).

Usage (the four packages' ``src`` on ``PYTHONPATH``, on an sm90 GPU):
``ncu --profile-from-start off --kernel-name regex:prefill_kernel --section ... python benchmarks/shift_cost_probe.py``
"""

from __future__ import annotations

import argparse

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
    torch.cuda.cudart().cudaProfilerStart()
    for label, pipe in pipes:
        pipe(wl.q, wl.k_cache, wl.v_cache, wl.batch)
        torch.cuda.synchronize()
        print(f"profiled: {label}")
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
