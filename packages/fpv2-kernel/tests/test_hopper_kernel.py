"""The native Hopper kernel through the Python binding, against the fp64 reference on the same CSR.

``hopper`` tests need an sm_90 GPU and a library built with the kernel; they run
on the device (``scripts/device_check.sh``). The kernel's own native grid (every
output poisoned, stray writes counted, compute-sanitizer) is
``tests/native/hopper_prefill_test.cu``; this file checks the binding end to end:
struct building, the bf16 hand-over of the pooled statistics, streams, refusals,
on both K/V paths (TMA at page sizes 128/256, the cp.async gather at 1/16), at
every head dim the loaded library was built for (``hopper_head_dims()``).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from fpv2.kernel import CorrectionPlan
from fpv2.kernel import _native as native
from fpv2.kernel.contracts import SUPPORTED_HEAD_DIMS
from fpv2.kernel.reference import dense_attention, pool_blocks, sparse_attention

SEQLENS_Q = [1000, 0, 513, 77]
SEQLENS_K = [1000, 300, 1800, 1290]

#: The head dims the library has an instantiation for; without a library every test skips in
#: _require_kernel, so the default build's d=128 stands in for the parametrisation.
BUILT_HEAD_DIMS = native.hopper_head_dims() or (128,)
#: Head dims the contracts accept but the library was not built for (refused by name).
UNBUILT_HEAD_DIMS = tuple(d for d in SUPPORTED_HEAD_DIMS if d not in BUILT_HEAD_DIMS)


def _keep_some(seed: int, probability: float):
    generator = torch.Generator().manual_seed(seed)

    def keep(segment):
        draws = torch.rand(len(segment.kept), generator=generator).tolist()
        band = set(segment.diagonal_band)  # always kept, as the index stage forces it
        return sorted(b for b, d in zip(segment.kept, draws) if d < probability or b in band)

    return keep


def _require_kernel() -> None:
    available, reason = native.hopper_available()
    if not available:
        pytest.skip(reason)


def _poisoned(case) -> torch.Tensor:
    return torch.full_like(case.q, float("nan"))


def _check(got: torch.Tensor, want: torch.Tensor, same: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), "rows left unwritten (NaN poison) or non-finite output"
    err = (got.double() - want).abs().max().item()
    ref_err = (same.double() - want).abs().max().item()
    # bf16 P in the PV product (and bf16 pooled statistics) on top of FlashAttention-3's rule
    assert err <= 2 * ref_err + 1e-2, f"kernel error {err:.3g} vs bf16-rounded PyTorch {ref_err:.3g}"


@pytest.mark.hopper
@pytest.mark.parametrize("correction", [False, True])
@pytest.mark.parametrize("page_size", [1, 16, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", BUILT_HEAD_DIMS)
def test_sparse_with_and_without_correction(paged_case, hand_index, head_dim, group, page_size, correction):
    _require_kernel()
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
        dtype=torch.bfloat16, device="cuda", seed=group * page_size + correction + head_dim,
    )  # fmt: skip
    index, _ = hand_index(
        case.batch, num_kv_heads=2, group=group, tile_size=128, block_size=128, keep=_keep_some(group, 0.3)
    )
    plan = CorrectionPlan(pool_blocks(case.k_cache, case.v_cache, case.batch)) if correction else None
    lse = torch.full(case.q.shape[:2], float("nan"), device="cuda")
    got = native.hopper_prefill(
        case.q, case.k_cache, case.v_cache, _poisoned(case), case.batch, index=index, plan=plan, lse=lse
    )
    want, want_lse = sparse_attention(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, compute_dtype=torch.float64, return_lse=True
    )
    same = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan).to(torch.bfloat16)
    _check(got, want, same)
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=0.0, atol=5e-3 if correction else 1e-3)


@pytest.mark.hopper
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("head_dim", BUILT_HEAD_DIMS)
def test_dense_on_a_side_stream(paged_case, head_dim, group):
    _require_kernel()
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=128,
        dtype=torch.bfloat16, device="cuda", seed=7 + group + head_dim,
    )  # fmt: skip
    stream = torch.cuda.Stream()
    out = _poisoned(case)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, out, case.batch)
    torch.cuda.current_stream().wait_stream(stream)
    want = dense_attention(case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64)
    same = dense_attention(case.q, case.k_cache, case.v_cache, case.batch).to(torch.bfloat16)
    _check(out, want, same)


@pytest.mark.hopper
@pytest.mark.parametrize(
    ("offset", "head_pad"),
    [(0, 8), (2, 0), (0, 2)],
    ids=["padded-aligned", "base-4-byte-aligned", "head-stride-not-16-bytes"],
)
@pytest.mark.parametrize("head_dim", BUILT_HEAD_DIMS)
def test_output_views_aligned_or_not(paged_case, hand_index, head_dim, offset, head_pad):
    # The epilogue stores 16 bytes per thread when out's base and strides are 16-byte multiples and falls back to
    # 4-byte stores otherwise: every case writes exactly the view (the NaN around it stays) with the same values.
    _require_kernel()
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=128,
        dtype=torch.bfloat16, device="cuda", seed=11 + offset + head_pad + head_dim,
    )  # fmt: skip
    index, _ = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=128, block_size=128, keep=_keep_some(3, 0.3))
    plan = CorrectionPlan(pool_blocks(case.k_cache, case.v_cache, case.batch))
    total_q, heads, d = case.q.shape
    size = total_q * heads * (d + head_pad) + offset
    storage = torch.full((size,), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = storage[offset:].view(total_q, heads, d + head_pad)[:, :, :d]
    native.hopper_prefill(case.q, case.k_cache, case.v_cache, out, case.batch, index=index, plan=plan)
    inputs = (case.q, case.k_cache, case.v_cache, case.batch, index)
    want = sparse_attention(*inputs, plan=plan, compute_dtype=torch.float64)
    same = sparse_attention(*inputs, plan=plan).to(torch.bfloat16)
    _check(out, want, same)
    outside = torch.ones_like(storage, dtype=torch.bool)
    outside[offset:].view(total_q, heads, d + head_pad)[:, :, :d] = False
    assert storage[outside].isnan().all(), "the kernel wrote outside the output view"


#: Short chunks after long cached prefixes: 2 requests x ceil(200 x 4 / 128) tiles x 2 KV heads = 28 CTAs, too
#: few for the H200's 132 SMs, so the launcher splits each tile's KV blocks (4 splits automatically).
SPLIT_SEQLENS_Q = [64, 200]
SPLIT_SEQLENS_K = [8192, 6000]


def _index_and_plan(case, hand_index, mode: str, keep):
    """``mode`` "dense": no index; "sparse": a hand index keeping ``keep``'s blocks; "corrected": plus its plan."""
    index = plan = None
    if mode != "dense":
        index, _ = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=128, block_size=128, keep=keep)
    if mode == "corrected":
        plan = CorrectionPlan(pool_blocks(case.k_cache, case.v_cache, case.batch))
    return index, plan


def _check_prefill_against_the_reference(case, index, plan) -> None:
    """The kernel on NaN-poisoned out / lse against the fp64 reference (dense without an index)."""
    lse = torch.full(case.q.shape[:2], float("nan"), device="cuda")
    got = native.hopper_prefill(
        case.q, case.k_cache, case.v_cache, _poisoned(case), case.batch, index=index, plan=plan, lse=lse
    )
    if index is None:
        want, want_lse = dense_attention(
            case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64, return_lse=True
        )
        same = dense_attention(case.q, case.k_cache, case.v_cache, case.batch).to(torch.bfloat16)
    else:
        want, want_lse = sparse_attention(
            case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, compute_dtype=torch.float64,
            return_lse=True,
        )  # fmt: skip
        same = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan).to(torch.bfloat16)
    _check(got, want, same)
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=0.0, atol=5e-3 if plan else 1e-3)


@pytest.mark.hopper
@pytest.mark.parametrize("splits", ["auto", "3", "16"])
@pytest.mark.parametrize("mode", ["dense", "sparse", "corrected"])
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("head_dim", BUILT_HEAD_DIMS)
def test_split_kv_matches_the_reference(paged_case, hand_index, monkeypatch, head_dim, page_size, mode, splits):
    # The splits' partial rows and the combine against the fp64 reference: a lost or double-counted part of
    # a tile's KV blocks, or a wrong merge weight, moves the output far beyond the bf16 rule. 16 splits leave
    # some splits of the short request's tiles without any KV tile (their rows carry lse -inf).
    _require_kernel()
    if splits != "auto":
        monkeypatch.setenv("FPV2_HOPPER_SPLITS", splits)
    case = paged_case(
        SPLIT_SEQLENS_Q, SPLIT_SEQLENS_K, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
        dtype=torch.bfloat16, device="cuda", seed=31 + page_size + head_dim + len(mode),
    )  # fmt: skip
    index, plan = _index_and_plan(case, hand_index, mode, _keep_some(5, 0.2))
    _check_prefill_against_the_reference(case, index, plan)


@pytest.mark.hopper
def test_forced_splits_without_workspace_are_refused(paged_case, monkeypatch):
    _require_kernel()
    monkeypatch.setenv("FPV2_HOPPER_SPLITS", "4")
    case = paged_case(
        SPLIT_SEQLENS_Q, SPLIT_SEQLENS_K, num_q_heads=8, num_kv_heads=2, head_dim=BUILT_HEAD_DIMS[0], page_size=128,
        dtype=torch.bfloat16, device="cuda", seed=3,
    )  # fmt: skip
    too_small = torch.empty(256, dtype=torch.uint8, device="cuda")
    with pytest.raises(native.NativeError, match="FPV2_HOPPER_SPLITS=4: 4 KV splits need"):
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, _poisoned(case), case.batch, workspace=too_small)
    monkeypatch.setenv("FPV2_HOPPER_SPLITS", "17")
    with pytest.raises(ValueError, match="FPV2_HOPPER_SPLITS=17"):
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, _poisoned(case), case.batch)


#: Per-128-token-block key gains: with q_gain 2 a block's score maximum spans about 1 to 30 nats, so the rows'
#: running maxima jump by up to ~30 nats from one visited block to the next, and fall as often.
JUMPING_GAINS = (0.125, 1.0, 0.5, 3.0, 1.5, 0.25, 4.0, 2.0)


@pytest.mark.hopper
@pytest.mark.parametrize("mode", ["dense", "sparse", "corrected"])
@pytest.mark.parametrize("page_size", [1, 128])
@pytest.mark.parametrize("head_dim", BUILT_HEAD_DIMS)
def test_jumping_maxima_across_blocks(paged_case, hand_index, head_dim, page_size, mode):
    # The online softmax's rescale over a wide range: the default inputs' maxima differ by a few nats between
    # blocks, these by up to ~30 both ways, so an output factor that is wrong only when it is tiny shows here
    # (the Triton twin's mutation check: a factor floored at 1e-3 fails it but passes the fp16 default inputs).
    _require_kernel()
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
        dtype=torch.bfloat16, device="cuda", seed=41 + page_size + head_dim + len(mode), key_block_gains=JUMPING_GAINS,
    )  # fmt: skip
    index, plan = _index_and_plan(case, hand_index, mode, _keep_some(7, 0.5))
    _check_prefill_against_the_reference(case, index, plan)


#: Uneven requests (query lengths and cached prefixes differ) with more CTAs than an H200 has SMs
#: (47 query tiles x 2 KV heads x 4 requests = 376): FPV2_HOPPER_WORK_ORDER=auto orders their tiles by work.
ORDER_SEQLENS_Q = [700, 3, 1500, 260]
ORDER_SEQLENS_K = [700, 903, 1628, 260]


def _workspace_bytes(case, index=None, plan=None) -> int:
    """What the library asks for the call (``fpv2_prefill_workspace_size``)."""
    args = native.prefill_args_struct(
        case.q, case.k_cache, case.v_cache, torch.empty_like(case.q), case.batch, index=index, plan=plan,
        pooled_dtype=torch.bfloat16,
    )  # fmt: skip
    needed = ctypes.c_uint64(0)
    native.check_status(
        native.load_native_library().fpv2_prefill_workspace_size(ctypes.byref(args), ctypes.byref(needed))
    )
    return needed.value


@pytest.mark.hopper
@pytest.mark.parametrize("schedule", ["auto", "forced", "persistent"])
@pytest.mark.parametrize("mode", ["dense", "sparse", "corrected"])
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("head_dim", BUILT_HEAD_DIMS)
def test_work_order_matches_the_reference(paged_case, hand_index, monkeypatch, head_dim, page_size, mode, schedule):
    # The kept-block work order (csrc/hopper/work_order.hpp) permutes which tile each CTA computes: a tile
    # left out keeps its NaN poison, one computed twice means another is left out. "auto" is the launcher's
    # rule for this uneven batch (asserted through the workspace it asks for), "forced" sets
    # FPV2_HOPPER_WORK_ORDER=1, "persistent" walks the sorted tiles with persistent CTAs (TMA pages only).
    _require_kernel()
    monkeypatch.setenv("FPV2_HOPPER_WORK_ORDER", "auto" if schedule == "auto" else "1")
    if schedule == "persistent":
        monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "1")
    case = paged_case(
        ORDER_SEQLENS_Q, ORDER_SEQLENS_K, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
        dtype=torch.bfloat16, device="cuda", seed=47 + page_size + head_dim + len(mode),
    )  # fmt: skip
    index, plan = _index_and_plan(case, hand_index, mode, _keep_some(9, 0.3))
    assert _workspace_bytes(case, index, plan) > 0, "the launcher did not order this uneven batch's tiles"
    _check_prefill_against_the_reference(case, index, plan)


@pytest.mark.hopper
def test_work_order_is_opt_in_and_auto_orders_uneven_batches_only(paged_case, monkeypatch):
    _require_kernel()
    d = BUILT_HEAD_DIMS[0]

    def case_of(seqlens_q, seqlens_k):
        return paged_case(seqlens_q, seqlens_k, num_q_heads=8, num_kv_heads=2, head_dim=d, page_size=128,
                          dtype=torch.bfloat16, device="cuda", seed=5)  # fmt: skip

    uneven = case_of(ORDER_SEQLENS_Q, ORDER_SEQLENS_K)
    monkeypatch.delenv("FPV2_HOPPER_WORK_ORDER", raising=False)
    assert _workspace_bytes(uneven) == 0, "the work order is opt-in (measured slower)"
    monkeypatch.setenv("FPV2_HOPPER_WORK_ORDER", "auto")
    assert _workspace_bytes(uneven) > 0
    # Equal fresh requests, and one request: the decoded order already starts the longest tiles first.
    assert _workspace_bytes(case_of([1500] * 4, [1500] * 4)) == 0
    assert _workspace_bytes(case_of([6000], [6000])) == 0
    monkeypatch.setenv("FPV2_HOPPER_WORK_ORDER", "0")
    assert _workspace_bytes(uneven) == 0
    monkeypatch.setenv("FPV2_HOPPER_WORK_ORDER", "1")
    assert _workspace_bytes(case_of([6000], [6000])) > 0
    too_small = torch.empty(256, dtype=torch.uint8, device="cuda")
    with pytest.raises(native.NativeError, match="FPV2_HOPPER_WORK_ORDER=1: the work order of .* tiles needs"):
        native.hopper_prefill(
            uneven.q, uneven.k_cache, uneven.v_cache, _poisoned(uneven), uneven.batch, workspace=too_small
        )
    monkeypatch.setenv("FPV2_HOPPER_WORK_ORDER", "yes")
    with pytest.raises(ValueError, match="FPV2_HOPPER_WORK_ORDER=yes: expected 0, 1 or auto"):
        native.hopper_prefill(uneven.q, uneven.k_cache, uneven.v_cache, _poisoned(uneven), uneven.batch)


@pytest.mark.hopper
@pytest.mark.parametrize("work_order", ["0", "1"])
@pytest.mark.parametrize("mode", ["dense", "sparse", "corrected"])
@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("head_dim", BUILT_HEAD_DIMS)
def test_dynamic_tile_queue_matches_the_reference(
    paged_case, hand_index, monkeypatch, head_dim, page_size, mode, work_order
):
    # FPV2_HOPPER_PERSISTENT=dynamic (csrc/hopper/tile_queue.hpp): persistent CTAs claim tiles from a counter
    # in the workspace; a tile claimed twice or never leaves a wrong or NaN-poisoned row. Page 16 runs one CTA
    # per tile (the gather path has no persistent CTAs) and must not ask for the counter.
    _require_kernel()
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "dynamic")
    monkeypatch.setenv("FPV2_HOPPER_WORK_ORDER", work_order)
    case = paged_case(
        ORDER_SEQLENS_Q, ORDER_SEQLENS_K, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
        dtype=torch.bfloat16, device="cuda", seed=91 + page_size + head_dim + len(mode),
    )  # fmt: skip
    index, plan = _index_and_plan(case, hand_index, mode, _keep_some(9, 0.3))
    asked = _workspace_bytes(case, index, plan)
    if page_size % 128 == 0 or work_order == "1":
        assert asked > 0
    else:
        assert asked == 0, "the gather path runs one CTA per tile: no tile counter"
    _check_prefill_against_the_reference(case, index, plan)


@pytest.mark.hopper
def test_dynamic_tile_queue_needs_its_workspace_and_the_overlapped_consumers(paged_case, monkeypatch):
    _require_kernel()
    case = paged_case([1500] * 2, [1500] * 2, num_q_heads=8, num_kv_heads=2, head_dim=BUILT_HEAD_DIMS[0],
                      page_size=128, dtype=torch.bfloat16, device="cuda", seed=6)  # fmt: skip
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "1")
    assert _workspace_bytes(case) == 0  # the static snake order
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "dynamic")
    assert _workspace_bytes(case) == 256
    too_small = torch.empty(128, dtype=torch.uint8, device="cuda")
    with pytest.raises(native.NativeError, match="FPV2_HOPPER_PERSISTENT=dynamic: the tile queue needs 256 bytes"):
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, _poisoned(case), case.batch, workspace=too_small)
    monkeypatch.setenv("FPV2_HOPPER_OVERLAP", "0")
    with pytest.raises(ValueError, match="FPV2_HOPPER_PERSISTENT=dynamic: the tile queue is built for the overlapped"):
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, _poisoned(case), case.batch)
    monkeypatch.delenv("FPV2_HOPPER_OVERLAP")
    monkeypatch.setenv("FPV2_HOPPER_PERSISTENT", "yes")
    with pytest.raises(ValueError, match="FPV2_HOPPER_PERSISTENT=yes: expected 0, 1 or dynamic"):
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, _poisoned(case), case.batch)


#: One request of 96K at 8 / 2 heads: 768 tiles x 4 (the group) x 2 KV heads = 6144 CTAs, where the default tile
#: queue starts (csrc/hopper/schedule_default.hpp; native.DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES).
LONG_SEQLENS = [98304]
#: A 4K chunk after a 4K cached prefix at 8 / 2 heads: 256 CTAs, more than the SMs of any Hopper part.
CHUNK_SEQLENS_Q, CHUNK_SEQLENS_K = [4096], [8192]


def _default_schedule_case(paged_case, seqlens_q, seqlens_k, head_dim=128, page_size=128, seed=3):
    return paged_case(seqlens_q, seqlens_k, num_q_heads=8, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
                      dtype=torch.bfloat16, device="cuda", seed=seed)  # fmt: skip


def _same_as_the_decoded_order(case, index, plan, monkeypatch, decoded_env: dict[str, str]) -> None:
    """The call under the default schedule (both switches unset) against ``decoded_env``'s, bit for bit: the same
    blocks in the same order in every tile (the reference tests above cover the decoded order); a tile left out
    would keep its NaN poison."""

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.full(case.q.shape[:2], float("nan"), device="cuda")
        out = native.hopper_prefill(case.q, case.k_cache, case.v_cache, _poisoned(case), case.batch, index=index,
                                    plan=plan, lse=lse)  # fmt: skip
        return out, lse

    by_default, by_default_lse = run()
    for name, value in decoded_env.items():
        monkeypatch.setenv(name, value)
    assert _workspace_bytes(case, index, plan) == 0
    decoded, decoded_lse = run()
    assert torch.isfinite(by_default).all() and torch.isfinite(by_default_lse).all(), "a tile left out (NaN poison)"
    assert torch.equal(by_default, decoded) and torch.equal(by_default_lse, decoded_lse)


def _unset_schedule_switches(monkeypatch) -> None:
    monkeypatch.delenv("FPV2_HOPPER_PERSISTENT", raising=False)
    monkeypatch.delenv("FPV2_HOPPER_WORK_ORDER", raising=False)


def _default_schedule_call(paged_case, hand_index, monkeypatch, seqlens_q, seqlens_k, mode, keep, seed):
    """A d = 128 call the default schedule covers (skips without the kernel or d = 128), both switches unset."""
    _require_kernel()
    if 128 not in BUILT_HEAD_DIMS:
        pytest.skip("the default schedule serves d = 128")
    case = _default_schedule_case(paged_case, seqlens_q, seqlens_k, seed=seed)
    index, plan = _index_and_plan(case, hand_index, mode, keep)
    _unset_schedule_switches(monkeypatch)
    return case, index, plan


def _bytes_under(case, index, plan, monkeypatch, env: dict[str, str]) -> int:
    """What the call asks for under ``env``'s switches (then unset again)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    needed = _workspace_bytes(case, index, plan)
    _unset_schedule_switches(monkeypatch)
    return needed


@pytest.mark.hopper
@pytest.mark.parametrize("mode", ["sparse", "corrected"])
def test_long_block_sparse_requests_run_the_tile_queue_by_default(paged_case, hand_index, monkeypatch, mode):
    # Both switches unset: a request of 6144 CTAs or more (block-sparse, d = 128, TMA pages) runs persistent CTAs
    # fed by the tile queue in the work order: it asks for what the explicit settings ask for.
    assert LONG_SEQLENS[0] * 4 // 128 * 2 == native.DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES
    case, index, plan = _default_schedule_call(paged_case, hand_index, monkeypatch, LONG_SEQLENS, LONG_SEQLENS, mode,
                                               _keep_some(23, 0.05), seed=17 + len(mode))  # fmt: skip
    queued = {"FPV2_HOPPER_PERSISTENT": "dynamic", "FPV2_HOPPER_WORK_ORDER": "1"}
    by_default = _workspace_bytes(case, index, plan)
    assert by_default == _bytes_under(case, index, plan, monkeypatch, queued) > 256, "not the queue in the order"
    _same_as_the_decoded_order(case, index, plan, monkeypatch, {"FPV2_HOPPER_PERSISTENT": "0"})


@pytest.mark.hopper
@pytest.mark.parametrize("mode", ["sparse", "corrected"])
def test_chunks_after_a_prefix_run_the_work_order_by_default(paged_case, hand_index, monkeypatch, mode):
    # Both switches unset: a chunk after a cached prefix with more CTAs than SMs runs one CTA per tile in the
    # kept-block work order (its permutation in the workspace, no tile queue).
    keep = _keep_some(31, 0.1)
    case, index, plan = _default_schedule_call(paged_case, hand_index, monkeypatch, CHUNK_SEQLENS_Q, CHUNK_SEQLENS_K,
                                               mode, keep, seed=29 + len(mode))  # fmt: skip
    by_default = _workspace_bytes(case, index, plan)
    ordered = _bytes_under(case, index, plan, monkeypatch, {"FPV2_HOPPER_WORK_ORDER": "1"})
    queued = _bytes_under(case, index, plan, monkeypatch,
                          {"FPV2_HOPPER_PERSISTENT": "dynamic", "FPV2_HOPPER_WORK_ORDER": "1"})  # fmt: skip
    assert by_default == ordered > 0 and queued > ordered, "not the work order alone"
    _same_as_the_decoded_order(case, index, plan, monkeypatch, {"FPV2_HOPPER_WORK_ORDER": "0"})


@pytest.mark.hopper
def test_the_default_schedule_leaves_other_calls_to_the_decoded_order(paged_case, hand_index, monkeypatch):
    # The chunk above under what the rule does not cover asks for no workspace: dense mode, other head dims,
    # pages the TMA cannot read (the gather), either switch set; and a fresh 16K request (4096 CTAs).
    _require_kernel()
    _unset_schedule_switches(monkeypatch)
    for head_dim in BUILT_HEAD_DIMS:
        case = _default_schedule_case(paged_case, CHUNK_SEQLENS_Q, CHUNK_SEQLENS_K, head_dim=head_dim)
        index, _ = _index_and_plan(case, hand_index, "sparse", _keep_some(5, 0.1))
        assert _workspace_bytes(case) == 0, f"dense mode, d = {head_dim}"
        assert (_workspace_bytes(case, index) > 0) == (head_dim == 128), f"block-sparse, d = {head_dim}"
        if head_dim == 128:
            for env in ({"FPV2_HOPPER_WORK_ORDER": "0"}, {"FPV2_HOPPER_WORK_ORDER": "auto"},
                        {"FPV2_HOPPER_PERSISTENT": "0"}):  # fmt: skip
                assert _bytes_under(case, index, None, monkeypatch, env) == 0, env
    gathered = _default_schedule_case(paged_case, CHUNK_SEQLENS_Q, CHUNK_SEQLENS_K, page_size=16)
    gathered_index, _ = _index_and_plan(gathered, hand_index, "sparse", _keep_some(5, 0.1))
    assert _workspace_bytes(gathered, gathered_index) == 0, "the gather path keeps the decoded order"
    fresh = _default_schedule_case(paged_case, [16384], [16384])
    fresh_index, _ = _index_and_plan(fresh, hand_index, "sparse", _keep_some(5, 0.1))
    assert _workspace_bytes(fresh, fresh_index) == 0, "a fresh 16K request keeps the decoded order"


@pytest.mark.hopper
@pytest.mark.parametrize("head_dim", UNBUILT_HEAD_DIMS)
def test_head_dims_it_was_not_built_for_are_refused(paged_case, head_dim):
    _require_kernel()
    case = paged_case([64], [64], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=16,
                      dtype=torch.bfloat16, device="cuda")  # fmt: skip
    built = ", ".join(map(str, BUILT_HEAD_DIMS))
    with pytest.raises(native.UnsupportedConfigurationError, match=f"head dim d={head_dim} .*built: d={built}"):
        native.hopper_prefill(case.q, case.k_cache, case.v_cache, torch.empty_like(case.q), case.batch)
