"""Shared helpers of the serving tests (imported as ``conftest``, like the kernel package's)."""

from __future__ import annotations

import torch


def hopper_runs_here() -> bool:
    """Whether the native Hopper kernel can run here: an sm_90 GPU and the library loaded."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    from fpv2.serving.backends import HopperBackend

    return HopperBackend().available()[0]


def same_output_in_and_out_of_inference_mode(pipeline: object, workload: object) -> torch.Tensor:
    """Run ``pipeline`` on ``workload`` inside, outside, then inside ``torch.inference_mode``; check they agree.

    vLLM runs its forward pass under inference mode; calls inside and outside it, in turn, reuse the
    pipeline's cached workspaces. Each call must select sparsely and all three must give the same output.

    Returns:
        The output of the first call.
    """
    outs = []
    for inference in (True, False, True):
        with torch.inference_mode(inference):
            result = pipeline(workload.q, workload.k_cache, workload.v_cache, workload.batch)
        outs.append(result.out)
        assert result.index.density(workload.batch) < 1.0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    return outs[0]
