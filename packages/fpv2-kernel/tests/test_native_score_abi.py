"""``fpv2_validate_score_blocks`` / ``fpv2_score_blocks`` (ABI 1.4): the index stage's scoring call.

CPU only: validation reads metadata, never tensor data, so CPU tensors stand in for device ones (see
``test_native_abi.py`` for how to point the tests at a library). Every refusal must name the field and say
what it found; a valid call validates, and a library without a GPU reports the CUDA failure instead of
launching.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from test_native_abi import LIB, _last_error, needs_library

from fpv2.kernel._native.codes import Status
from fpv2.kernel._native.score import ScoreRule, score_args_struct

pytestmark = needs_library


def _args(**changes: object):
    """A valid call: 2 requests (q 300 / 100 of KV 1000 / 100), 32/8 heads, d = 128, bf16, 128-token blocks."""
    d = changes.pop("d", 128)
    dtype = changes.pop("dtype", torch.bfloat16)
    hq, hkv = changes.pop("heads", (32, 8))
    q_lens, kv_lens = [300, 100], [1000, 100]
    group = hq // hkv
    num_tiles = sum(-(-n * group // 128) for n in q_lens)
    blocks = [-(-k // 128) for k in kv_lens]
    max_blocks = changes.pop("max_blocks", max(blocks))
    words = changes.pop("words", 2 * -(-max_blocks // 64))
    segments = hkv * num_tiles
    tensors = dict(
        q=torch.zeros(sum(q_lens), hq, d, dtype=dtype),
        keys=torch.zeros(sum(blocks), hkv, d, dtype=changes.pop("keys_dtype", dtype)),
        cu_seqlens_q=torch.tensor([0, 300, 400], dtype=torch.int32),
        seqlens_k=torch.tensor(kv_lens, dtype=torch.int32),
        block_offsets=torch.tensor([0, blocks[0], sum(blocks)], dtype=torch.int32),
        tile_offsets=torch.zeros(3, dtype=torch.int32),
        offsets=torch.zeros(segments + 1, dtype=torch.int32),
        counts=torch.zeros(segments, dtype=torch.int32),
        keep_bits=torch.zeros(segments, words, dtype=torch.int32),
    )
    tensors.update({k: changes.pop(k) for k in list(changes) if k in tensors})
    rule = ScoreRule(alpha=changes.pop("alpha", 0.1), block_size=changes.pop("block_size", 128), sink_blocks=2)
    args = score_args_struct(
        **tensors, num_tiles=changes.pop("num_tiles", num_tiles), max_blocks=max_blocks, rule=rule,
        tile_size=changes.pop("tile_size", 128),
    )  # fmt: skip
    for name, value in changes.items():
        setattr(args, name, value)
    return args


def _validate(args) -> int:
    return LIB.fpv2_validate_score_blocks(ctypes.byref(args))


def test_a_valid_call_validates() -> None:
    assert _validate(_args()) == Status.OK, _last_error()
    assert _validate(_args(d=64, dtype=torch.float16)) == Status.OK, _last_error()


@pytest.mark.parametrize(
    ("changes", "status", "needle"),
    [
        ({"d": 96}, Status.UNSUPPORTED, "head dim d=96"),
        ({"d": 256}, Status.UNSUPPORTED, "head dim d=256"),
        ({"dtype": torch.float32}, Status.UNSUPPORTED, "must be bf16 or f16"),
        ({"keys_dtype": torch.float16}, Status.INVALID_ARGUMENT, "keys must have q's dtype bf16"),
        ({"group": 2}, Status.INVALID_ARGUMENT, "group=2 must equal Hq / Hkv = 32 / 8"),
        ({"tile_size": 64}, Status.UNSUPPORTED, "tile_size=64"),
        ({"block_size": 96}, Status.INVALID_ARGUMENT, "block_size must be a power of two; got 96"),
        ({"max_blocks": 16385}, Status.UNSUPPORTED, "max_blocks=16385"),
        ({"words": 1}, Status.INVALID_ARGUMENT, "holds 1 words per segment"),
        ({"alpha": float("nan")}, Status.INVALID_ARGUMENT, "alpha must be finite"),
        ({"num_tiles": 3}, Status.INVALID_ARGUMENT, "fpv2_score_args_t.offsets"),
        ({"num_requests": 0}, Status.INVALID_ARGUMENT, "num_requests must be >= 1"),
        ({"window_tokens": -1}, Status.INVALID_ARGUMENT, "must be >= 0"),
        ({"seqlens_k": torch.zeros(2, dtype=torch.int64)}, Status.INVALID_ARGUMENT, "seqlens_k"),
        ({"counts": torch.zeros(5, dtype=torch.int32)}, Status.INVALID_ARGUMENT, "fpv2_score_args_t.counts"),
    ],
    ids=lambda v: str(v)[:40] if not isinstance(v, dict) else ",".join(v),
)
def test_refusals_name_the_field(changes, status, needle) -> None:
    if changes.get("alpha") is not None and changes["alpha"] != changes["alpha"]:
        args = _args()
        args.alpha = float("nan")  # the Python helper refuses NaN itself: set it on the struct
    else:
        args = _args(**changes)
    assert _validate(args) == status, _last_error()
    assert needle in _last_error()


def test_a_struct_smaller_than_the_library_s_is_refused() -> None:
    args = _args()
    args.struct_size = ctypes.sizeof(args) - 8
    assert _validate(args) == Status.INVALID_ARGUMENT
    assert "fpv2_score_args_t.struct_size" in _last_error()


def test_scoring_without_a_usable_gpu_reports_instead_of_launching() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the GPU tests of fpv2-index run the kernel")
    status = LIB.fpv2_score_blocks(ctypes.byref(_args()))
    assert status in (Status.CUDA, Status.NOT_BUILT), _last_error()
    assert _last_error()
