"""Scoring pass 1 with the mean correction's pooled terms, against a float64 reference (interpreter on CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from fpv2.index.triton.corrected_scoring import TILE_ROWS, score_with_correction
from fpv2.kernel.triton.relaunch import interpreter_enabled

LOG2E = math.log2(math.e)
# The compiled kernel on a GPU (fp32 operands take IEEE products there), the interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_enabled() else "cpu"


def _inputs(q_lens, kv_lens, hq, hkv, d, block_size, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    total_q = sum(q_lens)
    q = torch.randn(total_q, hq, d, generator=gen)
    blocks = [-(-n // block_size) for n in kv_lens]
    total_blocks = sum(blocks)
    # Keys with a spread of scales so the running row maxima move and some rows sit far below others.
    pooled_k = torch.randn(total_blocks, hkv, d, generator=gen) * torch.rand(total_blocks, 1, 1, generator=gen) * 2
    pooled_v = torch.randn(total_blocks, hkv, d, generator=gen)
    lengths = []
    for n, nb in zip(kv_lens, blocks, strict=True):
        lengths += [block_size] * (nb - 1) + [n - (nb - 1) * block_size]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    block_offsets = torch.tensor([0, *torch.tensor(blocks).cumsum(0).tolist()], dtype=torch.int32)
    scale = d**-0.5
    keys = (pooled_k * (scale * LOG2E)).contiguous()
    return dict(
        q=q.to(device),
        cu_seqlens_q=cu_q.to(device),
        seqlens_k=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        keys=keys.to(device),
        values=pooled_v.to(device),
        block_lengths=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_offsets=block_offsets.to(device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(kv_lens),
        block_size=block_size,
    )


def _reference(args):
    """Energies of every scored block; softmax of every row over its tile's eligible pooled terms (float64)."""
    q, keys, values = (args[k].double().cpu() for k in ("q", "keys", "values"))
    lengths = args["block_lengths"].double().cpu()
    cu_q, seqlens_k, offsets = (args[k].cpu().tolist() for k in ("cu_seqlens_q", "seqlens_k", "block_offsets"))
    bk = args["block_size"]
    hq, hkv = q.shape[1], keys.shape[1]
    g = hq // hkv
    tiles = -(-args["max_seqlen_q"] * g // TILE_ROWS)
    nb_max = -(-args["max_seqlen_k"] // bk)
    energies = torch.full((len(seqlens_k), hkv, tiles, nb_max), float("-inf"), dtype=torch.float64)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for b, kv_len in enumerate(seqlens_k):
        q_len = cu_q[b + 1] - cu_q[b]
        prefix = kv_len - q_len
        for h in range(hkv):
            k_b = keys[offsets[b] : offsets[b + 1], h]
            v_b = values[offsets[b] : offsets[b + 1], h]
            len_b = lengths[offsets[b] : offsets[b + 1]]
            for t in range(-(-q_len * g // TILE_ROWS)):
                rows = torch.arange(t * TILE_ROWS, min((t + 1) * TILE_ROWS, q_len * g))
                tokens = cu_q[b] + rows // g
                heads = h * g + rows % g
                pos = prefix + rows // g
                s = q[tokens, heads] @ k_b.T  # (rows, blocks), log2 units
                num_scored = (int(pos[-1]) + 1) // bk
                ids = torch.arange(k_b.shape[0])
                visible = (ids[None, :] * bk <= pos[:, None]) & (ids[None, :] < num_scored)
                e = torch.logsumexp(torch.where(visible, s, float("-inf")) / LOG2E, dim=0) * LOG2E
                energies[b, h, t, :num_scored] = e[:num_scored]
                num_eligible = int(pos[0]) // bk
                if num_eligible == 0:
                    continue
                logits = s[:, :num_eligible] + torch.log2(len_b[:num_eligible])[None, :]
                w = torch.softmax(logits / LOG2E, dim=1)
                out[tokens, heads] = w @ v_b[:num_eligible]
                lse[tokens, heads] = torch.logsumexp(logits / LOG2E, dim=1) * LOG2E
    return energies, out, lse


def _assert_energies_match(got, ref):
    """Equal scored entries, and equal energies relative to the tile's peak down to 2^-100 of it (below that a
    block cannot reach any threshold alpha >= 2^-100; the kernel may drop rows more than 126 below the peak)."""
    got = got.cpu()
    scored = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got) | (got == float("-inf")) & scored, scored | torch.isfinite(got))
    peak = ref.amax(dim=-1, keepdim=True).expand_as(ref)
    rel_ref = (ref - peak)[scored].clamp(min=-100)
    rel_got = (got.double() - peak)[scored].clamp(min=-100)
    torch.testing.assert_close(rel_got, rel_ref, rtol=1e-5, atol=1e-4)
    assert not torch.isfinite(got[~scored]).any()


def _assert_correction_match(got, out, lse):
    got_lse, got_out = got.lse.cpu(), got.out.cpu()
    has_terms = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(got_lse), has_terms)
    torch.testing.assert_close(got_lse[has_terms].double(), lse[has_terms], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_out.double(), out, rtol=1e-4, atol=1e-5)


CASES = [
    # q_lens, kv_lens, hq, hkv, d, block_size: GQA 1/2/4, prefixes, partial tiles, varlen
    ([200], [200], 4, 4, 32, 16),
    ([96, 150], [400, 150], 8, 4, 64, 16),
    ([130, 70], [330, 530], 8, 2, 32, 32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-bk{c[5]}")
def test_matches_reference(case):
    q_lens, kv_lens, hq, hkv, d, bk = case
    args = _inputs(q_lens, kv_lens, hq, hkv, d, bk, seed=sum(q_lens) + hq)
    got = score_with_correction(**args, block_n=16, num_warps=4)
    energies, out, lse = _reference(args)
    assert torch.isfinite(lse).any(), "the case should give some rows eligible blocks"
    _assert_energies_match(got.energies, energies)
    _assert_correction_match(got, out, lse)


def test_each_half_alone_matches_the_whole_pass():
    args = _inputs([150], [300], 8, 2, 32, 16, seed=3)
    both = score_with_correction(**args, block_n=16, num_warps=4)
    energies = score_with_correction(**args, accumulate=False, block_n=16, num_warps=4)
    assert energies.out is None and energies.lse is None
    torch.testing.assert_close(energies.energies, both.energies, rtol=0, atol=0)
    terms = score_with_correction(**args, energies=False, block_n=16, num_warps=4)
    assert terms.energies is None
    torch.testing.assert_close(terms.out, both.out, rtol=0, atol=0)
    torch.testing.assert_close(terms.lse, both.lse, rtol=0, atol=0)
    with pytest.raises(ValueError, match="nothing to compute"):
        score_with_correction(**args, energies=False, accumulate=False)


def test_rows_far_below_the_peak():
    """One head's logits reach ~200 (log2), the other's are 0: the low head's rows drop out of the energies
    (their share of the peak is ~2^-200) without changing any selection, and keep their exact correction."""
    args = _inputs([64], [256], 2, 1, 32, 16, seed=5)
    sink = args["keys"][0, 0]
    args["q"][:, 0] = 0.0
    args["q"][:, 1] = sink / sink.square().sum() * 200.0  # logit 200 against block 0
    got = score_with_correction(**args, block_n=16, num_warps=4)
    energies, out, lse = _reference(args)
    assert energies[0, 0, 0, 0] > 190, "the case needs a peak far above the low head's logits"
    _assert_energies_match(got.energies, energies)
    for alpha in (2.0**-60, 1e-3, 0.1):
        peak = energies.amax(dim=-1, keepdim=True)
        ref_keep = energies - peak >= math.log2(alpha)
        got_keep = got.energies.cpu().double() - peak >= math.log2(alpha)
        assert torch.equal(got_keep, ref_keep)
    _assert_correction_match(got, out, lse)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: a.update(q=a["q"].to(torch.int32)), TypeError, "q must have dtype"),
        (lambda a: a.update(keys=a["keys"][:, :, :-1]), ValueError, "keys .* and values"),
        (lambda a: a.update(block_lengths=a["block_lengths"][:-1]), ValueError, "block_lengths has"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][:-1]), ValueError, "B\\+1"),
        (lambda a: a.update(seqlens_k=a["seqlens_k"].long()), TypeError, "seqlens_k must have dtype"),
        (lambda a: a.update(q=a["q"][:, :3]), ValueError, "not a multiple"),
    ],
)
def test_bad_input_is_refused(change, error, match):
    args = _inputs([40], [80], 4, 2, 32, 16, seed=1)
    change(args)
    with pytest.raises(error, match=match):
        score_with_correction(**args)
