"""The Triton kernel against independent computations: dense mode, sparse CSR, mean correction, FP8, paging, varlen.

On CPU machines the kernel runs under the Triton interpreter: the nox ``tests``
session exports ``TRITON_INTERPRET=1`` (it must be set before ``triton`` is first
imported). Interpreter tests use fp16/fp32 inputs and tiny shapes; bf16 and FP8
go through the kernel's fp32-operand path there. ``gpu`` tests cover the larger
grid on a CUDA device.

Accuracy follows FlashAttention-3's rule: the kernel's largest error against an
fp64 oracle may be at most twice that of a PyTorch computation in the same
precision (logits, probabilities and output rounded to the input dtype), plus
``1e-3``. Output buffers are poisoned with NaN first, so an unwritten row fails.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "the Triton kernel needs a CUDA GPU, or TRITON_INTERPRET=1 in the environment before triton is imported "
        "(the nox tests session sets it on CPU machines)",
        allow_module_level=True,
    )
pytest.importorskip("triton")

from fpv2.kernel import CorrectionPlan
from fpv2.kernel.reference import (
    dense_attention,
    dequantize_queries,
    gather_kv,
    pool_blocks,
    quantize_cache,
    quantize_probabilities,
    quantize_queries,
    sparse_attention,
)
from fpv2.kernel.triton import BLOCK_M, LaunchConfig, is_interpreted, launch_config, sparse_attention_triton
from fpv2.kernel.triton.todo_words import todo_words

INTERPRETED = is_interpreted()
needs_compiled_gpu = pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(), reason="needs a CUDA GPU with compiled (not interpreted) Triton"
)

# Varlen batch: a plain request with a partial tail block, a zero-length request on a cached
# prefix, and a short request on a prefix of 380 tokens (diagonal band across two blocks,
# partial tail block 3).
SEQLENS_Q = [200, 0, 90]
SEQLENS_K = [200, 40, 470]


# --------------------------------------------------------------------------- helpers
def random_keep(seed: int, probability: float = 0.35):
    """Keep the diagonal band, block 0 and each other visible block with ``probability`` (deterministic)."""

    def keep(seg):
        rng = random.Random(hash((seed, seg.request, seg.kv_head, seg.tile)))
        others = [j for j in seg.kept if j not in seg.diagonal_band and j != 0]
        return [0, *seg.diagonal_band, *(j for j in others if rng.random() < probability)]

    return keep


def todo_plan(statistics, segments, *, explicit: bool) -> CorrectionPlan:
    """A plan over ``statistics``; with ``explicit`` its todo words are written out here, bit by bit."""
    if not explicit:
        return CorrectionPlan(statistics)
    offsets, words = [0], []
    for seg in segments:
        kept = set(seg.kept)
        seg_words = [0] * (-(-seg.num_eligible // 64))
        for j in range(seg.num_eligible):
            if j not in kept:
                seg_words[j // 64] |= 1 << (j % 64)
        words.extend(w - (1 << 64) if w >= 1 << 63 else w for w in seg_words)
        offsets.append(len(words))
    device = statistics.pooled_k.device
    return CorrectionPlan(
        statistics,
        torch.tensor(offsets, dtype=torch.int32, device=device),
        torch.tensor(words, dtype=torch.int64, device=device),
    )


def correction_columns(case, segments, block_size: int, scale: float):
    """``(b, hq) -> (logits, values)`` of the mean correction, from the contiguous keys in fp64.

    Every block of the request is one column; a row sees column ``J`` (logit
    ``q . mean(K_J) * scale + log |B_J|``) only when ``J`` is todo for the row's tile.
    """
    g = case.group
    todo: dict[tuple[int, int], torch.Tensor] = {}
    for seg in segments:
        kv_len = case.seqlens_k[seg.request]
        nblocks = -(-kv_len // block_size)
        cols = [j for j in range(seg.num_eligible) if j not in set(seg.kept)]
        for r in range(seg.row_begin, seg.row_end):
            key = (seg.request, seg.kv_head * g + r % g)
            if key not in todo:
                todo[key] = torch.zeros(case.seqlens_q[seg.request], nblocks, dtype=torch.bool)
            todo[key][r // g, cols] = True

    def extra(b: int, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
        h = hq // g
        keys, values = case.keys[b][:, h].double(), case.values[b][:, h].double()
        kv_len = keys.shape[0]
        nblocks = -(-kv_len // block_size)
        lengths = torch.tensor([min(block_size, kv_len - j * block_size) for j in range(nblocks)], dtype=torch.float64)
        kbar = torch.stack([keys[j * block_size : (j + 1) * block_size].mean(0) for j in range(nblocks)])
        vbar = torch.stack([values[j * block_size : (j + 1) * block_size].mean(0) for j in range(nblocks)])
        start = sum(case.seqlens_q[:b])
        q = case.q[start : start + case.seqlens_q[b], hq].double().cpu()
        logits = q @ kbar.T * scale + torch.log(lengths)[None, :]
        return logits.masked_fill(~todo[(b, hq)], -math.inf), vbar

    return extra


def same_precision(
    case,
    dtype: torch.dtype,
    *,
    scale: float | None = None,
    allowed=None,
    extra=None,
    round_logits: bool = True,
    round_probs=None,
) -> torch.Tensor:
    """The PyTorch attention FA3's tests compare against: logits, P and output rounded to ``dtype``.

    Args:
        round_logits: round the logits to ``dtype`` (FP8 kernels keep fp32 logits: pass False).
        round_probs: how P is rounded (default: to ``dtype``), e.g. the e4m3 rounding of FP8 kernels.
    """
    q_all = case.q.float().cpu()
    d = q_all.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(case.seqlens_q, case.seqlens_k)):
        prefix = kv_len - q_len
        for hq in range(q_all.shape[1]):
            if q_len == 0:
                continue
            h = hq // case.group
            keys, values = case.keys[b][:, h].float(), case.values[b][:, h].float()
            logits = q_all[start : start + q_len, hq] @ keys.T * scale
            mask = torch.arange(kv_len)[None, :] <= prefix + torch.arange(q_len)[:, None]
            if allowed is not None:
                mask &= allowed(b, hq)
            logits = logits.masked_fill(~mask, -math.inf)
            if extra is not None:
                extra_logits, extra_values = extra(b, hq)
                logits = torch.cat([logits, extra_logits.float()], dim=1)
                values = torch.cat([values, extra_values.float()], dim=0)
            if round_logits:
                logits = logits.to(dtype).float()
            row_max = logits.amax(dim=1, keepdim=True).clamp(min=-1e30)  # rows that see nothing stay 0
            probs = torch.exp(logits - row_max)
            denom = probs.sum(dim=1, keepdim=True).clamp(min=1e-30)
            probs = round_probs(probs) if round_probs is not None else probs.to(dtype).float()
            out[start : start + q_len, hq] = (probs @ values / denom).to(dtype).double()
        start += q_len
    return out


def poisoned(case, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output buffer full of NaN: any row the kernel does not write stays NaN."""
    return torch.full(case.q.shape, math.nan, dtype=dtype or case.q.dtype, device=case.q.device)


def check_fa3_rule(got: torch.Tensor, want: torch.Tensor, same_prec: torch.Tensor, *, factor: float = 2.0) -> None:
    """Every row written; ``max|got - want| <= factor * max|same_prec - want| + 1e-3``."""
    got = got.double().cpu()
    assert torch.isfinite(got).all(), "the kernel left rows unwritten (NaN poison) or produced non-finite values"
    err = (got - want).abs().max().item()
    ref_err = (same_prec - want).abs().max().item()
    assert err <= factor * ref_err + 1e-3, f"kernel error {err:.3g} vs same-precision PyTorch {ref_err:.3g}"


def check_lse(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-4, rtol: float = 0.0) -> None:
    """lse in natural log, -inf exactly where the oracle has no visible column."""
    got = got.double().cpu()
    assert got.dtype == torch.float64 and torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=rtol, atol=atol)


def check_sparse_against_masked_oracle(case, oracle, hand_index, index_token_masks, group: int, keep):
    """The fp16 kernel over a hand index keeping ``keep``'s blocks against the fp64 oracle on the same keys.

    Returns ``(output, index)``.
    """
    index, segments = hand_index(case.batch, num_kv_heads=2, group=group, tile_size=BLOCK_M, block_size=128, keep=keep)
    allowed = index_token_masks(case, segments, 128)
    want, want_lse = oracle(case, allowed=allowed)
    got, lse = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, index, out=poisoned(case), return_lse=True
    )
    check_fa3_rule(got, want, same_precision(case, torch.float16, allowed=allowed))
    check_lse(lse, want_lse)
    return got, index


#: FP8 lse tolerance: on Hopper, Triton accumulates e4m3 products at the tensor cores' reduced
#: FP8 accumulation precision (measured up to 5.5e-4 relative on an H200); exact in the interpreter.
FP8_LSE_RTOL = 1e-3


# --------------------------------------------------------------------------- dense mode
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_dense_mode_matches_dense_attention(paged_case, oracle, device, group, page_size):
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, page_size=page_size, dtype=torch.float16,
        device=device, seed=group + page_size,
    )  # fmt: skip
    want, want_lse = oracle(case)
    out = poisoned(case)
    got, lse = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, out=out, return_lse=True)
    assert got is out and got.dtype == torch.float16 and lse.shape == (sum(SEQLENS_Q), 2 * group)
    check_fa3_rule(got, want, same_precision(case, torch.float16))
    check_lse(lse, want_lse)
    # the fp32 PyTorch reference agrees too (it is what the other fast paths are compared with)
    ref = dense_attention(case.q, case.k_cache, case.v_cache, case.batch)
    assert (got.double().cpu() - ref.double().cpu()).abs().max().item() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_mode_other_dtypes_scale_and_strided_out(paged_case, oracle, device, dtype):
    """fp32 (IEEE products) and bf16 inputs, a custom scale, and an output view with a head stride of 2."""
    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=16, dtype=dtype, device=device)
    want, want_lse = oracle(case, scale=0.2)
    storage = torch.full((case.q.shape[0], 16, 64), math.nan, dtype=dtype, device=device)
    out = storage[:, ::2]  # strides (16*64, 128, 1): the kernel must honour them
    got, lse = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, softmax_scale=0.2, out=out, return_lse=True
    )
    assert got.dtype == dtype and torch.isnan(storage[:, 1::2]).all(), "wrote outside the strided view"
    check_fa3_rule(got, want, same_precision(case, dtype, scale=0.2))
    check_lse(lse, want_lse)


@pytest.mark.parametrize("page_size", [1, 16])
def test_jumping_maxima_across_blocks(paged_case, oracle, hand_index, index_token_masks, device, page_size):
    """Keys of the fourth 128-token block scaled 32x the others': a row's maximum jumps by about 20 nats there.

    The output accumulated before the jump must shrink by a factor near 2^-28; an output factor floored at 1e-3
    (checked by mutating the kernel) fails here; of this file's other tests only the fp32 dense one catches it.
    """
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=page_size, dtype=torch.float16,
        device=device, seed=19 + page_size, key_block_gains=(0.125, 0.125, 0.125, 4.0),
    )  # fmt: skip
    want, want_lse = oracle(case)
    got, lse = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, out=poisoned(case), return_lse=True
    )
    check_fa3_rule(got, want, same_precision(case, torch.float16))
    check_lse(lse, want_lse)
    check_sparse_against_masked_oracle(case, oracle, hand_index, index_token_masks, 4, random_keep(3, 0.5))


def test_dense_mode_equals_an_index_of_every_visible_block(paged_case, hand_index, device):
    """Dense mode walks blocks 0..last_visible exactly as a CSR listing all of them: identical bits."""
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=1, dtype=torch.float16, device=device
    )
    index, _ = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=BLOCK_M, block_size=128)
    dense = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch)
    full = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index)
    assert torch.equal(dense, full)


# --------------------------------------------------------------------------- sparse
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_sparse_matches_token_masked_oracle(
    paged_case, oracle, hand_index, index_token_masks, device, group, page_size
):
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, page_size=page_size, dtype=torch.float16,
        device=device, seed=7 * group + page_size,
    )  # fmt: skip
    got, index = check_sparse_against_masked_oracle(
        case, oracle, hand_index, index_token_masks, group, random_keep(group)
    )
    assert 0 < index.density(case.batch) < 1
    dense = oracle(case)[0]
    assert (got.double().cpu() - dense).abs().max().item() > 0.05, "pruning had no effect: the index was ignored"


@pytest.mark.parametrize(("explicit_words", "block_size"), [(True, 128), (False, 128), (False, 64)])
def test_mean_correction_matches_oracle_and_reference(
    paged_case, oracle, hand_index, index_token_masks, device, explicit_words, block_size
):
    """Todo words from the plan or derived from the CSR in the kernel; 64-token blocks are one sub-tile each."""
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=1, dtype=torch.float16, device=device, seed=11
    )
    index, segments = hand_index(
        case.batch, num_kv_heads=2, group=4, tile_size=BLOCK_M, block_size=block_size, keep=random_keep(5, 0.2)
    )
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=block_size)
    plan = todo_plan(stats, segments, explicit=explicit_words)
    allowed = index_token_masks(case, segments, block_size)
    extra = correction_columns(case, segments, block_size, 1 / 8)
    want, want_lse = oracle(case, allowed=allowed, extra=extra)
    got, lse = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, out=poisoned(case), return_lse=True
    )
    check_fa3_rule(got, want, same_precision(case, torch.float16, allowed=allowed, extra=extra))
    check_lse(lse, want_lse)
    uncorrected = oracle(case, allowed=allowed)[0]
    assert (want - uncorrected).abs().max().item() > 0.05, "the test's correction adds nothing: it cannot fail"
    ref = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan)
    assert (got.double().cpu() - ref.double().cpu()).abs().max().item() < 2e-3


#: Launch overrides of the several-chunks test: steps of 128 pooled vectors (two todo words
#: per step), of 16 (four steps per word), no software pipelining, grid in segment order.
LAUNCH_VARIANTS = {
    "table": None,
    "step128": dict(correction_step=128, correction_stages=2),
    "step16_unpipelined": dict(block_n=16, num_stages=1, correction_step=16, correction_stages=1, reverse_grid=False),
}


@pytest.mark.parametrize("launch", sorted(LAUNCH_VARIANTS))
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("explicit_words", [True, False])
def test_correction_over_several_chunks(
    paged_case, oracle, hand_index, index_token_masks, device, explicit_words, head_dim, launch
):
    """16-token blocks, 3 chunks of 64: chunk 0 all kept (todo word 0), bit 63 of chunk 1 set.

    At d = 256 the table walks each 64-bit word in two steps of 32 pooled vectors; the
    launch variants walk two words per step, or four steps per word, without pipelining.
    """
    if launch == "step128" and head_dim == 256:
        pytest.skip("d = 256 keeps steps of 32 pooled vectors (registers)")
    case = paged_case(
        [40], [2500], num_q_heads=1, num_kv_heads=1, head_dim=head_dim, page_size=16, dtype=torch.float16,
        device=device,
    )  # fmt: skip

    def keep(seg):
        rng = random.Random(seg.tile)
        middle = [j for j in range(64, 127) if rng.random() < 0.1]
        return [*range(64), *middle, *seg.diagonal_band]

    index, segments = hand_index(case.batch, num_kv_heads=1, group=1, tile_size=BLOCK_M, block_size=16, keep=keep)
    seg = segments[0]
    assert seg.num_eligible > 128 and 127 not in seg.kept
    plan = todo_plan(
        pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=16), segments, explicit=explicit_words
    )
    if explicit_words:
        words = plan.todo_masks.tolist()
        assert len(words) == 3 and words[0] == 0 and words[1] < 0  # sign bit = block 127
    overrides = LAUNCH_VARIANTS[launch]
    config = None if overrides is None else dataclasses.replace(launch_config(head_dim, 16), **overrides)
    allowed = index_token_masks(case, segments, 16)
    extra = correction_columns(case, segments, 16, 1 / math.sqrt(head_dim))
    want, want_lse = oracle(case, allowed=allowed, extra=extra)
    got, lse = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, out=poisoned(case), return_lse=True,
        launch=config,
    )  # fmt: skip
    check_fa3_rule(got, want, same_precision(case, torch.float16, allowed=allowed, extra=extra))
    check_lse(lse, want_lse)


def expected_words(segments, n_words: int) -> list[list[int]]:
    """Per segment, its ``n_words`` todo words as unsigned ints, written out bit by bit from the segment."""
    out = []
    for seg in segments:
        kept = set(seg.kept)
        words = [0] * n_words
        for j in range(seg.num_eligible):
            if j not in kept:
                words[j // 64] |= 1 << (j % 64)
        out.append(words)
    return out


@pytest.mark.parametrize("group", [1, 4])
def test_todo_words_built_on_the_device_follow_the_rule(paged_case, hand_index, device, group):
    """Varlen + prefix, 16-token blocks (up to 3 words), fully kept and fully pruned tiles, spare CSR capacity."""
    case = paged_case(
        [300, 0, 41, 520], [2500, 40, 1100, 520], num_q_heads=2 * group, num_kv_heads=2, page_size=16,
        dtype=torch.float16, device=device,
    )  # fmt: skip

    def keep(seg):
        rng = random.Random(hash((seg.request, seg.kv_head, seg.tile)))
        if seg.tile % 3 == 1:
            return seg.kept  # every visible block: no todo bit at all
        if seg.tile % 3 == 2:
            return list(seg.diagonal_band)  # every eligible block pruned
        return [j for j in seg.kept if j in seg.diagonal_band or rng.random() < 0.3]

    index, segments = hand_index(case.batch, num_kv_heads=2, group=group, tile_size=BLOCK_M, block_size=16, keep=keep)
    # spare capacity after the kept ids (the contract allows it; kernels must not read it)
    spare = torch.full((37,), -1, dtype=torch.int32, device=device)
    spare[::2] = 5
    index = dataclasses.replace(index, blocks=torch.cat([index.blocks, spare]))
    offsets, words = todo_words(index, case.batch)
    n_words = -(-2500 // 16 // 64)  # blocks of the longest request, 64 per word
    assert n_words == 3 and offsets.tolist() == [s * n_words for s in range(len(segments) + 1)]
    got = [[w & (2**64 - 1) for w in words.tolist()[s * n_words : (s + 1) * n_words]] for s in range(len(segments))]
    want = expected_words(segments, n_words)
    assert got == want
    assert any(w[2] for w in want) and any(w[0] >> 63 for w in want), "the case must reach word 2 and bit 63"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the check is a device-side assertion")
def test_statistics_of_another_batch_are_refused_without_a_host_read(paged_case, hand_index, device):
    """Same request count and total blocks, lengths swapped: the on-device offsets check fires."""
    case = paged_case([100, 30], [300, 130], num_q_heads=2, num_kv_heads=2, page_size=16, dtype=torch.float16,
                      device=device)  # fmt: skip
    other = paged_case([30, 100], [130, 300], num_q_heads=2, num_kv_heads=2, page_size=16, dtype=torch.float16,
                       device=device)  # fmt: skip
    index, _ = hand_index(case.batch, num_kv_heads=2, group=1, tile_size=BLOCK_M, block_size=64)
    wrong = pool_blocks(other.k_cache, other.v_cache, other.batch, block_size=64)
    with pytest.raises(RuntimeError, match="block_offsets"):
        sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(wrong))
    longer = paged_case(
        [100, 30], [300, 200], num_q_heads=2, num_kv_heads=2, page_size=16, dtype=torch.float16, device=device
    )
    extra_block = pool_blocks(longer.k_cache, longer.v_cache, longer.batch, block_size=64)
    with pytest.raises(ValueError, match="9 pooled blocks; the batch needs 8"):
        sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(extra_block))
    right = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=64)
    out = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(right))
    assert torch.isfinite(out).all()


def test_launch_table_has_an_entry_per_mode():
    """Dense mode, sparse and sparse with correction compile separately and may differ; block_n is clamped."""
    from fpv2.kernel.triton.tuning import MODE_OVERRIDES, TUNING_TABLE

    assert launch_config(128, 128, "dense") == MODE_OVERRIDES[(128, "dense", False)] != TUNING_TABLE[128]
    assert launch_config(128, 128, "sparse", fp8=True) == TUNING_TABLE[128] == launch_config(128, 128)
    assert launch_config(128, 32, "sparse").block_n == 32
    with pytest.raises(ValueError, match="mode"):
        launch_config(128, 128, "paged")


def test_launch_override_is_checked(paged_case, hand_index, device):
    case = paged_case([40], [100], num_q_heads=2, num_kv_heads=2, page_size=16, dtype=torch.float16, device=device)
    index, _ = hand_index(case.batch, num_kv_heads=2, group=1, tile_size=BLOCK_M, block_size=32)
    with pytest.raises(ValueError, match="does not divide"):
        sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, launch=LaunchConfig(64, 4, 2))
    with pytest.raises(TypeError, match="LaunchConfig"):
        sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, launch=(32, 4, 2))


def test_correction_is_exact_on_blockwise_constant_keys(paged_case, oracle, hand_index, device):
    """K and V constant within each block: pooled pairs equal every token, so sparse + correction == dense."""
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=2, num_kv_heads=2, page_size=16, dtype=torch.float16, device=device,
        constant_blocks=128, seed=2,
    )  # fmt: skip
    index, _ = hand_index(
        case.batch, num_kv_heads=2, group=1, tile_size=BLOCK_M, block_size=128, keep=random_keep(3, 0.0)
    )
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch)
    want, want_lse = oracle(case)
    got, lse = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(stats), return_lse=True
    )
    check_fa3_rule(got, want, same_precision(case, torch.float16))
    check_lse(lse, want_lse)
    dropped = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index)
    assert (dropped.double().cpu() - want).abs().max().item() > 0.05, "nothing was pruned"


def test_correction_weighs_pooled_columns_by_the_statistics_block_lengths(paged_case, hand_index, device):
    """Each pooled column counts ``block_lengths[J]`` tokens, as the statistics say, not the block size.

    The geometry makes every eligible block a full one, so lengths from 1 to the block size
    are written over them here (the contract allows any): the kernel must apply each.
    """
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=16, dtype=torch.float16, device=device, seed=4
    )
    index, _ = hand_index(case.batch, num_kv_heads=2, group=4, tile_size=BLOCK_M, block_size=64, keep=random_keep(9))
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=64)
    generator = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, 65, stats.block_lengths.shape, generator=generator, dtype=torch.int32)
    reweighted = dataclasses.replace(stats, block_lengths=lengths.to(stats.block_lengths.device))
    got = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(reweighted), out=poisoned(case)
    )
    want = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(reweighted))
    assert (got.double().cpu() - want.double().cpu()).abs().max().item() < 2e-3
    full = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=CorrectionPlan(stats))
    assert (want.double() - full.double()).abs().max().item() > 0.02, "the lengths change nothing: it cannot fail"


def test_rows_without_visible_keys_are_zero_with_minus_inf_lse(
    paged_case, oracle, hand_index, index_token_masks, device
):
    """A hand-made index that drops the diagonal: rows that see no key get 0 and lse -inf, not NaN."""
    case = paged_case([200], [264], num_q_heads=1, num_kv_heads=1, page_size=16, dtype=torch.float16, device=device)
    # prefix 64: tile 0 holds absolute positions 64..191; keeping only block 1 (tokens 128..255)
    # hides every key from the 64 rows at 64..127.
    index, segments = hand_index(
        case.batch, num_kv_heads=1, group=1, tile_size=BLOCK_M, block_size=128, keep=lambda seg: [1]
    )
    want, want_lse = oracle(case, allowed=index_token_masks(case, segments, 128))
    got, lse = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, index, out=poisoned(case), return_lse=True
    )
    blind = torch.isneginf(want_lse)
    assert blind.sum() == 64
    assert torch.equal(got[blind.to(got.device)].cpu(), torch.zeros(64, 64, dtype=torch.float16))
    check_fa3_rule(got, want, same_precision(case, torch.float16, allowed=index_token_masks(case, segments, 128)))
    check_lse(lse, want_lse)


# --------------------------------------------------------------------------- FP8
def fp8_case(case, group: int):
    """Quantise a case's Q/K/V to e4m3 (per-request V scales made distinct) and its dequantised twin."""
    batch = case.batch
    q8, qd = quantize_queries(case.q, batch, case.num_kv_heads)
    k8, kd = quantize_cache(case.k_cache, batch)
    v8, vd = quantize_cache(case.v_cache, batch)
    # distinct per-request V descales: the kernel must use each request's own
    vd = vd * torch.linspace(0.5, 2.0, batch.num_requests, device=vd.device)[:, None]
    keys = [gather_kv(k8, batch, b).float().cpu() * kd[b].cpu()[None, :, None] for b in range(batch.num_requests)]
    values = [gather_kv(v8, batch, b).float().cpu() * vd[b].cpu()[None, :, None] for b in range(batch.num_requests)]
    real = dataclasses.replace(case, q=dequantize_queries(q8, qd, batch), keys=keys, values=values)
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd), real


@pytest.mark.parametrize("correction", [False, True])
def test_fp8_matches_dequantised_oracle(paged_case, oracle, hand_index, index_token_masks, device, correction):
    """Descales per (request, KV head), P rounded to e4m3 after the 2^8 shift, bf16 output."""
    case = paged_case(
        SEQLENS_Q, SEQLENS_K, num_q_heads=8, num_kv_heads=2, page_size=16, dtype=torch.float32, device=device,
        fill=0.0, seed=4,
    )  # fmt: skip
    (q8, k8, v8), scales, real = fp8_case(case, 4)
    index, segments = hand_index(
        case.batch, num_kv_heads=2, group=4, tile_size=BLOCK_M, block_size=128, keep=random_keep(9, 0.2)
    )
    allowed = index_token_masks(case, segments, 128)
    plan, extra = None, None
    if correction:
        stats = pool_blocks(k8, v8, case.batch, k_descale=scales["k_descale"], v_descale=scales["v_descale"])
        plan, extra = CorrectionPlan(stats), correction_columns(real, segments, 128, 1 / 8)
    want, want_lse = oracle(real, allowed=allowed, extra=extra)
    out = torch.full(case.q.shape, math.nan, dtype=torch.bfloat16, device=device)
    got, lse = sparse_attention_triton(q8, k8, v8, case.batch, index, plan=plan, out=out, return_lse=True, **scales)
    assert got is out and got.dtype == torch.bfloat16
    emulated = same_precision(
        real, torch.bfloat16, allowed=allowed, extra=extra, round_logits=False, round_probs=quantize_probabilities
    )
    check_fa3_rule(got, want, emulated)
    check_lse(lse, want_lse, atol=1e-3, rtol=FP8_LSE_RTOL)  # l sums the unrounded probabilities


# --------------------------------------------------------------------------- refusals
def test_bad_arguments_are_refused(paged_case, hand_index, device):
    case = paged_case([40], [100], num_q_heads=4, num_kv_heads=2, page_size=16, dtype=torch.float16, device=device)
    q, k, v, batch = case.q, case.k_cache, case.v_cache, case.batch
    index, _ = hand_index(batch, num_kv_heads=2, group=2, tile_size=BLOCK_M, block_size=128)
    stats = pool_blocks(k, v, batch)
    with pytest.raises(ValueError, match="plan was given without an index"):
        sparse_attention_triton(q, k, v, batch, plan=CorrectionPlan(stats))
    small_tiles, _ = hand_index(batch, num_kv_heads=2, group=2, tile_size=64, block_size=128)
    with pytest.raises(ValueError, match="tile_size=64 differs from the kernel's query tile 128"):
        sparse_attention_triton(q, k, v, batch, small_tiles)
    other_group, _ = hand_index(batch, num_kv_heads=2, group=4, tile_size=BLOCK_M, block_size=128)
    with pytest.raises(ValueError):
        sparse_attention_triton(q, k, v, batch, other_group)
    one_head, _ = hand_index(batch, num_kv_heads=1, group=2, tile_size=BLOCK_M, block_size=128)
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        sparse_attention_triton(q, k, v, batch, one_head)
    with pytest.raises(TypeError, match="index must be a BlockIndex"):
        sparse_attention_triton(q, k, v, batch, index.blocks)
    with pytest.raises(TypeError, match="plan must be a CorrectionPlan"):
        sparse_attention_triton(q, k, v, batch, index, plan=stats)
    with pytest.raises(ValueError, match="block_size=64"):
        sparse_attention_triton(q, k, v, batch, index, plan=CorrectionPlan(pool_blocks(k, v, batch, block_size=64)))
    bad_todo = CorrectionPlan(
        stats, torch.zeros(2, dtype=torch.int32, device=device), torch.zeros(0, dtype=torch.int64, device=device)
    )
    with pytest.raises(ValueError, match="todo_offsets"):
        sparse_attention_triton(q, k, v, batch, index, plan=bad_todo)
    with pytest.raises(TypeError, match="out must have dtype"):
        sparse_attention_triton(q, k, v, batch, out=torch.empty(q.shape, dtype=torch.float32, device=device))
    with pytest.raises(ValueError, match="out must have shape"):
        sparse_attention_triton(q, k, v, batch, out=torch.empty(40, 4, 32, dtype=q.dtype, device=device))
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_attention_triton(q, k, v, batch, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="q_descale is only meaningful"):
        sparse_attention_triton(q, k, v, batch, q_descale=torch.ones(1, 2, device=device))
    with pytest.raises(TypeError, match="share one dtype"):
        sparse_attention_triton(q.float(), k, v, batch)


def test_fp16_correction_with_huge_blocks_is_refused(paged_case, hand_index, device):
    """fp16 PV operands hold the pooled probabilities, which reach the block length: past 32768 it is refused."""
    case = paged_case(SEQLENS_Q, SEQLENS_K, num_q_heads=2, num_kv_heads=2, dtype=torch.float16, device=device, seed=1)
    for block_size, refused in ((32768, False), (65536, True)):
        index, _ = hand_index(case.batch, num_kv_heads=2, group=1, tile_size=BLOCK_M, block_size=block_size,
                              keep=random_keep(1))  # fmt: skip
        plan = CorrectionPlan(pool_blocks(case.k_cache, case.v_cache, case.batch, block_size=block_size))
        if refused:
            with pytest.raises(ValueError, match="fp16 inputs with a correction plan need block_size <= 32768"):
                sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan)
        else:
            got = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan)
            assert torch.isfinite(got).all()


def test_block_index_with_tiny_blocks_is_refused(paged_case, hand_index, device):
    case = paged_case([40], [100], num_q_heads=2, num_kv_heads=2, page_size=16, dtype=torch.float16, device=device)
    index, _ = hand_index(case.batch, num_kv_heads=2, group=1, tile_size=BLOCK_M, block_size=8)
    with pytest.raises(ValueError, match="block_size=8 is below"):
        sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, index)


# --------------------------------------------------------------------------- GPU grid
GPU_SEQLENS_Q = [1000, 0, 513, 77]
GPU_SEQLENS_K = [1000, 300, 1800, 1290]


def _check_gpu_bf16(case, index, plan) -> None:
    """Kernel vs fp64 reference on the same CSR, FA3-style against bf16-rounded fp32 PyTorch; lse; poisoned out."""
    want, want_lse = sparse_attention(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, compute_dtype=torch.float64, return_lse=True
    )
    got, lse = sparse_attention_triton(
        case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan, out=poisoned(case), return_lse=True
    )
    # fp32 math on the same bf16 inputs, rounded to bf16 like the kernel's output
    same = sparse_attention(case.q, case.k_cache, case.v_cache, case.batch, index, plan=plan)
    same = same.to(torch.bfloat16).double()
    assert torch.isfinite(got).all(), "rows left unwritten (NaN poison) or non-finite output"
    err = (got.double() - want).abs().max().item()
    ref_err = (same - want).abs().max().item()
    # the kernel also rounds P to bf16 (the PyTorch side does not): allow 1e-2 on top of the FA3 rule
    assert err <= 2 * ref_err + 1e-2, f"kernel error {err:.3g} vs bf16-rounded PyTorch {ref_err:.3g}"
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=0.0, atol=1e-3)


@pytest.mark.gpu
@needs_compiled_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_bf16_sparse_with_correction(paged_case, hand_index, group, page_size, head_dim):
    """GQA 1/4/8 x page sizes 1/16/64 x d 64/128/256, varlen + prefix, mean correction on."""
    case = paged_case(
        GPU_SEQLENS_Q, GPU_SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
        dtype=torch.bfloat16, device="cuda", seed=group * page_size + head_dim,
    )  # fmt: skip
    index, segments = hand_index(
        case.batch, num_kv_heads=2, group=group, tile_size=BLOCK_M, block_size=128, keep=random_keep(head_dim, 0.3)
    )
    stats = pool_blocks(case.k_cache, case.v_cache, case.batch)
    _check_gpu_bf16(case, index, todo_plan(stats, segments, explicit=group == 4))


@pytest.mark.gpu
@needs_compiled_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 8])
def test_gpu_bf16_sparse_and_dense_without_correction(paged_case, hand_index, group, head_dim):
    case = paged_case(
        GPU_SEQLENS_Q, GPU_SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=16,
        dtype=torch.bfloat16, device="cuda", seed=group + head_dim,
    )  # fmt: skip
    index, _ = hand_index(
        case.batch, num_kv_heads=2, group=group, tile_size=BLOCK_M, block_size=128, keep=random_keep(head_dim, 0.3)
    )
    _check_gpu_bf16(case, index, None)
    dense = sparse_attention_triton(case.q, case.k_cache, case.v_cache, case.batch, out=poisoned(case))
    want = dense_attention(case.q, case.k_cache, case.v_cache, case.batch, compute_dtype=torch.float64)
    same = dense_attention(case.q, case.k_cache, case.v_cache, case.batch).to(torch.bfloat16).double()
    err, ref_err = (dense.double() - want).abs().max().item(), (same - want).abs().max().item()
    assert torch.isfinite(dense).all() and err <= 2 * ref_err + 1e-2, f"dense error {err:.3g} vs {ref_err:.3g}"


@pytest.mark.gpu
@needs_compiled_gpu
@pytest.mark.parametrize(
    ("group", "page_size", "head_dim", "correction"),
    [(4, 1, d, c) for d in (64, 128, 256) for c in (False, True)] + [(8, 64, d, True) for d in (64, 128, 256)],
)
def test_gpu_fp8(paged_case, hand_index, index_token_masks, oracle, group, page_size, head_dim, correction):
    """FP8 e4m3 on fp8 tensor cores: FA3 rule against PyTorch with P rounded to e4m3 the same way."""
    case = paged_case(
        GPU_SEQLENS_Q, GPU_SEQLENS_K, num_q_heads=2 * group, num_kv_heads=2, head_dim=head_dim, page_size=page_size,
        dtype=torch.float32, device="cuda", fill=0.0, seed=group + page_size + head_dim,
    )  # fmt: skip
    (q8, k8, v8), scales, real = fp8_case(case, group)
    index, segments = hand_index(
        case.batch, num_kv_heads=2, group=group, tile_size=BLOCK_M, block_size=128, keep=random_keep(head_dim, 0.3)
    )
    plan = None
    if correction:
        plan = CorrectionPlan(
            pool_blocks(k8, v8, case.batch, k_descale=scales["k_descale"], v_descale=scales["v_descale"])
        )
    want, want_lse = sparse_attention(
        q8, k8, v8, case.batch, index, plan=plan, compute_dtype=torch.float64, return_lse=True, **scales
    )
    out = torch.full(case.q.shape, math.nan, dtype=torch.bfloat16, device="cuda")
    got, lse = sparse_attention_triton(q8, k8, v8, case.batch, index, plan=plan, out=out, return_lse=True, **scales)
    assert torch.isfinite(got).all()
    extra = correction_columns(real, segments, 128, 1 / math.sqrt(head_dim)) if correction else None
    emulated = same_precision(
        real, torch.bfloat16, allowed=index_token_masks(case, segments, 128), extra=extra, round_logits=False,
        round_probs=quantize_probabilities,
    )  # fmt: skip
    check_fa3_rule(got, want.double().cpu(), emulated)
    check_lse(lse, want_lse.double().cpu(), atol=1e-3, rtol=FP8_LSE_RTOL)
