"""The scoring pass on Hopper's tensor cores: when the index's selection runs the kernel library's wgmma
scoring (``fpv2_score_blocks``, :mod:`fpv2.kernel._native.score`) instead of the fused Triton pass.

Both apply the same rule to the same prepared keys and write the same keep bits, counts and offsets (up
to blocks whose energy ratio lies within rounding of ``alpha``); the compaction that follows is shared.
``$FPV2_INDEX_SCORING`` chooses: ``auto`` (the default) takes the Hopper kernel wherever it serves the call (an
sm_90 GPU, a library built with the Hopper code, bf16 or fp16 queries, head dims 64 and 128, 128-row tiles,
every row scored, at most 16384 key blocks per request) and the Triton pass elsewhere; ``triton`` always takes
the Triton pass; ``hopper`` requires the kernel and raises where it cannot serve.

On the H200 the Hopper kernel is the faster of the two (scoring kernel alone, identical indexes: 1.449 against
1.557 ms at 128K, 0.155 against 0.171 ms at 32K, 5.79 against 6.26 ms at 4 x 128K), its launch takes less host
time than the Triton pass's, and the whole eager selection call is 2-8% faster (1.77-1.78 against 1.85-1.87 ms
at 128K, 0.263-0.267 against 0.269-0.277 ms at 32K, 6.22-6.26 against 6.70-6.76 ms at 4 x 128K), prefix-sum
launch included (``benchmarks/results/2026-12-04-h200-hopper-scoring/refactor-bc22149/``, the landed kernel).
"""

from __future__ import annotations

import functools
import os

import torch

from ..config import SelectionConfig

#: Environment variable choosing the scoring pass: ``auto``, ``triton`` or ``hopper``.
SCORING_ENV = "FPV2_INDEX_SCORING"
SCORING_MODES = ("auto", "triton", "hopper")


def scoring_mode() -> str:
    """The scoring pass asked for by ``$FPV2_INDEX_SCORING`` (unset or empty: ``auto``).

    Raises:
        ValueError: an unknown value.
    """
    mode = os.environ.get(SCORING_ENV, "").strip().lower() or "auto"
    if mode not in SCORING_MODES:
        raise ValueError(f"{SCORING_ENV}={mode!r}; expected one of {', '.join(SCORING_MODES)}")
    return mode


@functools.cache
def _library_reason(device_index: int) -> str | None:
    """Why the kernel library cannot score on this device (None: it can). Cached per device."""
    from fpv2.kernel._native import hopper_available

    ok, reason = hopper_available()
    if not ok:
        return reason
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"the Hopper scoring kernel needs an sm_90 GPU; device {device_index} is sm_{major}{minor}"
    return None


def device_scoring_reason(device_index: int | None = None) -> str | None:
    """Why the Hopper scoring kernel cannot run on a device at all, or None when it can (per call, the dtype,
    head dim, tile and length still decide: :func:`hopper_scoring_reason`).

    Args:
        device_index: a CUDA device index; None takes the current device.

    Returns:
        The reason, or None.
    """
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return _library_reason(torch.cuda.current_device() if device_index is None else device_index)


def hopper_scoring_reason(
    q: torch.Tensor, config: SelectionConfig, head_dim: int, max_blocks: int, has_q_descale: bool
) -> str | None:
    """Why the Hopper scoring kernel cannot serve this call, or None when it can.

    Args:
        q: the call's queries.
        config: the selection parameters.
        head_dim: the pooled keys' head dim.
        max_blocks: key blocks of the longest request.
        has_q_descale: FP8 queries (their descales) are given.
    """
    from fpv2.kernel._native.score import SCORE_DTYPES, SCORE_HEAD_DIMS, SCORE_MAX_BLOCKS

    if not q.is_cuda:
        return "the queries are not on a CUDA device"
    if q.dtype not in SCORE_DTYPES or has_q_descale:
        return f"the kernel scores bf16 and fp16 queries; got {q.dtype}"
    if head_dim not in SCORE_HEAD_DIMS:
        return f"the kernel is built for head dims {SCORE_HEAD_DIMS}; got {head_dim}"
    if config.tile_size != 128 or config.probe_stride != 1:
        return (
            f"the kernel scores every row of 128-row tiles; got tile_size={config.tile_size}, "
            f"probe_stride={config.probe_stride}"
        )
    if max_blocks > SCORE_MAX_BLOCKS:
        return f"a request has {max_blocks} key blocks; the kernel takes at most {SCORE_MAX_BLOCKS}"
    return device_scoring_reason(q.device.index)


def use_hopper_scoring(
    q: torch.Tensor, config: SelectionConfig, head_dim: int, max_blocks: int, has_q_descale: bool
) -> bool:
    """Whether this call's scoring runs on the Hopper kernel (``$FPV2_INDEX_SCORING``, see the module).

    Raises:
        ValueError: ``FPV2_INDEX_SCORING=hopper`` and the kernel cannot serve the call (the message says why),
            or an unknown mode.
    """
    mode = scoring_mode()
    if mode == "triton":
        return False
    reason = hopper_scoring_reason(q, config, head_dim, max_blocks, has_q_descale)
    if reason is not None and mode == "hopper":
        raise ValueError(f"{SCORING_ENV}=hopper, but the Hopper scoring kernel cannot serve this call: {reason}")
    return reason is None
