"""``attn_implementation="fpv2"`` for transformers: tiny random models, sdpa as the reference.

CPU tests run the fpv2 pipeline with the PyTorch reference backend in fp32; the
GPU test (``@pytest.mark.gpu``) runs a 16K-token bf16 prefill with the default
backend. No weights are downloaded: every model is built from a config.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from fpv2.index import SelectionConfig  # noqa: E402
from fpv2.kernel.reference.sparse import expand_block_mask  # noqa: E402
from fpv2.kernel.testing import planted_workload  # noqa: E402
from fpv2.serving.adapters.transformers_attention import (  # noqa: E402
    Fpv2Attention,
    get_fpv2_attention,
    register_fpv2_attention,
)
from fpv2.serving.adapters.transformers_kv_view import dense_kv_as_pages, page_size_for  # noqa: E402
from fpv2.serving.adapters.transformers_mask import causal_key_length, fpv2_mask  # noqa: E402

# Small sinks and windows so that a 1K-token prompt has blocks to prune (the defaults,
# 256 sink and 512 window tokens, leave about one prunable block per head at 1K).
SPARSE = SelectionConfig(min_sparse_kv_len=0, sink_tokens=128, window_tokens=128)


def llama(seed: int = 0, *, layers: int = 2, sharpen: float = 1.0) -> LlamaForCausalLM:
    """A tiny random Llama (head dim 64, GQA 4/2); ``sharpen`` scales q_proj and k_proj weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        intermediate_size=512,
        vocab_size=256,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).eval()
    if sharpen != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(sharpen)
                layer.self_attn.k_proj.weight.mul_(sharpen)
    return model


def prompt(length: int, seed: int = 1, *, run: int = 1, vocab: int = 256) -> torch.Tensor:
    """``(1, length)`` random token ids, each drawn token repeated ``run`` times."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (math.ceil(length / run),), generator=gen).repeat_interleave(run)
    return ids[None, :length]


def logits(model: torch.nn.Module, impl: str, ids: torch.Tensor, **kw) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kw).logits


def generate(model: torch.nn.Module, impl: str, ids: torch.Tensor, new: int = 8) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


class Layer(torch.nn.Module):
    """Stand-in attention module for direct calls (what the functions read from a layer)."""

    def __init__(self, group: int) -> None:
        super().__init__()
        self.is_causal = True
        self.layer_idx = 0
        self.num_key_value_groups = group


@pytest.fixture(scope="module")
def dense_impl() -> str:
    register_fpv2_attention(strategy="dense", name="fpv2_test_dense")
    return "fpv2_test_dense"


@pytest.fixture(scope="module")
def sparse_impl() -> str:
    register_fpv2_attention(config=SPARSE, name="fpv2_test_sparse", track_density=True)
    return "fpv2_test_sparse"


# ---------------------------------------------------------------- the KV view
@pytest.mark.parametrize(
    ("kv_len", "slots", "layout", "page_size"),
    [
        (256, 256, "bhtd", 128),
        (300, 300, "bthd", 4),
        (301, 301, "bhtd", 1),
        (200, 320, "bhtd", 8),
        (96, 96, "mixed", 32),
    ],
)
def test_kv_view_reads_each_row_through_the_page_table(kv_len, slots, layout, page_size):
    gen = torch.Generator().manual_seed(kv_len)
    base = torch.randn(2, 3, slots, 64, generator=gen)
    if layout == "bhtd":
        key, value = base, base + 1.0
    else:
        # Physically (B, T, H, d), as transformers' RoPE output often is; "mixed": V differs from K.
        key = base.transpose(1, 2).contiguous().transpose(1, 2)
        value = key + 1.0 if layout == "bthd" else base + 1.0
    view = dense_kv_as_pages(key, value, q_len=kv_len // 2, kv_len=kv_len)
    batch = view.batch
    assert view.copied == (layout == "mixed")
    assert batch.page_size == page_size
    assert batch.host.seqlens_k == [kv_len, kv_len] and batch.host.q_lens == [kv_len // 2] * 2
    pos = torch.arange(kv_len)
    for b in range(2):
        pages = batch.page_table[b].long()[pos // batch.page_size]
        got_k = view.k_cache[pages, pos % batch.page_size]  # (kv_len, H, d)
        got_v = view.v_cache[pages, pos % batch.page_size]
        assert torch.equal(got_k, key[b, :, :kv_len].transpose(0, 1))
        assert torch.equal(got_v, value[b, :, :kv_len].transpose(0, 1))
    if not view.copied:
        assert view.k_cache.untyped_storage().data_ptr() == key.untyped_storage().data_ptr()


def test_page_size_is_the_largest_power_of_two_dividing():
    assert page_size_for(16384, None) == 128
    assert page_size_for(300, None) == 4
    assert page_size_for(301, None) == 1
    assert page_size_for(256, 3 * 200) == 8  # the row stride must be whole pages too
    with pytest.raises(ValueError, match="kv_len"):
        page_size_for(0, None)


def test_kv_view_refuses_bad_lengths():
    k = torch.zeros(1, 2, 10, 64)
    with pytest.raises(ValueError, match="q_len=11"):
        dense_kv_as_pages(k, k, q_len=11, kv_len=10)
    with pytest.raises(ValueError, match="key and value"):
        dense_kv_as_pages(k, torch.zeros(1, 2, 9, 64), q_len=2, kv_len=9)


# ------------------------------------------------------------------ the mask
def test_mask_is_sdpas_and_is_read_back():
    # Plain prefill and decode: None, as for sdpa.
    assert fpv2_mask(batch_size=1, q_length=8, kv_length=8) is None
    assert fpv2_mask(batch_size=1, q_length=1, kv_length=9, q_offset=8) is None
    # Prefill on a cached prefix: a bottom-right causal mask, recognised with its length.
    prefix = fpv2_mask(batch_size=2, q_length=5, kv_length=12, q_offset=7)
    assert torch.equal(prefix, sdpa_mask(batch_size=2, q_length=5, kv_length=12, q_offset=7))
    assert causal_key_length(prefix, 5) == 12
    # Static cache with 4 unused slots after the keys: length 8 of 12 slots.
    pad_future = torch.tensor([[True] * 8 + [False] * 4])
    static = fpv2_mask(batch_size=1, q_length=3, kv_length=12, q_offset=5, attention_mask=pad_future)
    assert causal_key_length(static, 3) == 8
    # Left padding, sliding windows, float masks and wrong shapes are not causal masks.
    padded = torch.tensor([[False, False] + [True] * 10, [True] * 12])
    assert causal_key_length(fpv2_mask(batch_size=2, q_length=12, kv_length=12, attention_mask=padded), 12) is None
    window = fpv2_mask(
        batch_size=1, q_length=12, kv_length=12, mask_function=sliding_window_causal_mask_function(4), local_size=4
    )
    assert window is not None and causal_key_length(window, 12) is None
    assert causal_key_length(prefix.float(), 5) is None
    assert causal_key_length(prefix, 4) is None
    assert fpv2_mask(batch_size=1, q_length=4, kv_length=4, mask_function=causal_mask_function) is None


# ------------------------------------------------------ direct calls, layouts
def planted_qkv(seeds: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Planted-workload rows in transformers' layout: ``(B, H, L, d)`` fp32, 4 query heads over 2 KV heads."""
    qs, ks, vs = [], [], []
    for seed in seeds:
        wl = planted_workload(
            [length], num_q_heads=4, num_kv_heads=2, head_dim=64, shuffle_pages=False, dtype=torch.float32, seed=seed
        )
        qs.append(wl.q.permute(1, 0, 2))
        ks.append(wl.k_cache[:, 0].permute(1, 0, 2))
        vs.append(wl.v_cache[:, 0].permute(1, 0, 2))
    return torch.stack(qs), torch.stack(ks), torch.stack(vs)


def test_sparse_call_equals_dense_attention_under_the_expanded_block_mask():
    # Independent check of the layouts: the adapter's output must be plain softmax attention
    # over exactly the kept tokens of its index (correction off), row by row.
    q, k, v = planted_qkv([5, 6], 1024)
    attention = Fpv2Attention(SPARSE, correction=False, backend="reference")
    seen = []
    remove = attention.add_prefill_hook(lambda module, batch, result: seen.append((batch, result)))
    scaling = 0.11
    out, weights = attention(Layer(2), q, k, v, None, scaling=scaling)
    remove()
    assert weights is None and out.shape == (2, 1024, 4, 64)
    (batch, result), *rest = seen
    assert not rest and result.index.density(batch) < 0.9  # 0.764 seen
    for b in range(2):
        for h in range(2):
            allowed = expand_block_mask(result.index, batch, b, h)  # (L * g, L), PackGQA rows
            for j in range(2):
                rows = allowed[j::2]  # query head 2h + j
                logits_ = (q[b, 2 * h + j] @ k[b, h].T) * scaling
                expected = torch.softmax(logits_.masked_fill(~rows, -math.inf), dim=-1) @ v[b, h]
                torch.testing.assert_close(out[b, :, 2 * h + j], expected, rtol=1e-5, atol=1e-5)
    assert attention.stats.pipeline_calls == 1 and attention.stats.pipeline_tokens == 2048


@pytest.mark.parametrize(("q_len", "kv_len"), [(384, 384), (257, 640)])
def test_dense_mode_call_equals_sdpa_with_the_models_scaling(q_len, kv_len):
    q, k, v = planted_qkv([7], kv_len)
    q = q[:, :, kv_len - q_len :]
    mask = fpv2_mask(batch_size=1, q_length=q_len, kv_length=kv_len, q_offset=kv_len - q_len)
    attention = Fpv2Attention(strategy="dense", backend="reference")
    out, _ = attention(Layer(2), q, k, v, mask, scaling=0.05)
    ref, _ = sdpa_attention_forward(Layer(2), q, k, v, mask, scaling=0.05)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert attention.stats.pipeline_calls == 1 and attention.stats.fallback_calls == 0


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"q_len": 1}, "decode"),
        ({"head_dim": 32}, "head dim"),
        ({"dtype": torch.float64}, "dtype"),
        ({"kwargs": {"sliding_window": 64}}, "sliding window"),
        ({"kwargs": {"is_causal": False}}, "non-causal"),
        ({"padded": True}, "padding"),
    ],
)
def test_unservable_calls_fall_back_to_sdpa_exactly(change, reason, caplog):
    gen = torch.Generator().manual_seed(0)
    d, q_len, kv_len = change.get("head_dim", 64), change.get("q_len", 40), 40
    dtype = change.get("dtype", torch.float32)
    q = torch.randn(2, 4, q_len, d, generator=gen, dtype=dtype)
    k = torch.randn(2, 2, kv_len, d, generator=gen, dtype=dtype)
    v = torch.randn(2, 2, kv_len, d, generator=gen, dtype=dtype)
    mask = None
    if change.get("padded"):
        pad = torch.ones(2, kv_len, dtype=torch.bool)
        pad[0, :3] = False
        mask = fpv2_mask(batch_size=2, q_length=q_len, kv_length=kv_len, attention_mask=pad)
    kwargs = change.get("kwargs", {})
    attention = Fpv2Attention(backend="reference")
    with caplog.at_level("INFO", logger="fpv2.serving.adapters.transformers_attention"):
        out, _ = attention(Layer(2), q, k, v, mask, scaling=0.2, **kwargs)
        attention(Layer(2), q, k, v, mask, scaling=0.2, **kwargs)
    ref, _ = sdpa_attention_forward(Layer(2), q, k, v, mask, scaling=0.2, **kwargs)
    assert torch.equal(out, ref)
    assert attention.stats.pipeline_calls == 0
    ((key, count),) = attention.stats.fallbacks.items()
    assert reason in key and count == 2
    assert sum(reason in r.getMessage() for r in caplog.records) == 1  # said once


def test_softcap_is_refused_since_sdpa_cannot_do_it_either():
    q, k, v = planted_qkv([1], 256)
    with pytest.raises(ValueError, match="softcap"):
        Fpv2Attention(backend="reference")(Layer(2), q, k, v, None, scaling=0.125, softcap=30.0)


def test_gradients_fall_back():
    q, k, v = (t.requires_grad_() for t in planted_qkv([1], 256))
    attention = Fpv2Attention(backend="reference")
    out, _ = attention(Layer(2), q, k, v, None, scaling=0.125)
    out.sum().backward()
    assert q.grad is not None and "gradients" in next(iter(attention.stats.fallbacks))


# -------------------------------------------------------------- registration
def test_registration_is_idempotent_and_refuses_transformers_names():
    register_fpv2_attention(name="fpv2_test_reg", strategy="dense")
    first = get_fpv2_attention("fpv2_test_reg")
    register_fpv2_attention(name="fpv2_test_reg", strategy="dense")
    assert get_fpv2_attention("fpv2_test_reg") is first
    assert AttentionInterface._global_mapping["fpv2_test_reg"] is first
    assert AttentionMaskInterface._global_mapping["fpv2_test_reg"] is fpv2_mask
    register_fpv2_attention(name="fpv2_test_reg", strategy="dense", correction=False)
    assert get_fpv2_attention("fpv2_test_reg") is not first
    for bad in ("sdpa", "eager", "", "paged|fpv2"):
        with pytest.raises(ValueError, match="name"):
            register_fpv2_attention(name=bad)
    with pytest.raises(KeyError, match="fpv2_never"):
        get_fpv2_attention("fpv2_never")
    with pytest.raises(ValueError, match="unknown selection strategy"):
        register_fpv2_attention(name="fpv2_test_bad", strategy="nope")


def test_import_registers_nothing_and_imports_no_engine():
    code = (
        "import sys; import fpv2.serving.adapters, fpv2.serving.adapters.transformers_attention; "
        "assert 'transformers' not in sys.modules, 'transformers imported'; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ------------------------------------------------------------- whole models
def test_llama_dense_mode_generates_the_sdpa_tokens(dense_impl):
    model, ids = llama(), prompt(300)
    stats = get_fpv2_attention(dense_impl).stats
    stats.reset()
    ref = generate(model, "sdpa", ids)
    out = generate(model, dense_impl, ids)
    assert out.shape == (1, 308)
    assert torch.equal(out, ref)
    # Prefill: one pipeline call per layer; the 7 decode steps after it: sdpa, per layer.
    assert stats.pipeline_calls == 2 and stats.pipeline_tokens == 600
    assert stats.fallbacks == {"decode": 14} and stats.decode_calls == 14
    torch.testing.assert_close(logits(model, dense_impl, ids), logits(model, "sdpa", ids), rtol=0, atol=1e-4)


def test_qwen3_dense_mode_generates_the_sdpa_tokens(dense_impl):
    qwen3 = pytest.importorskip("transformers.models.qwen3")
    torch.manual_seed(0)
    config = qwen3.Qwen3Config(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
        intermediate_size=512,
        vocab_size=256,
        max_position_embeddings=4096,
    )
    model = qwen3.Qwen3ForCausalLM(config).eval()
    ids = prompt(300, seed=2)
    stats = get_fpv2_attention(dense_impl).stats
    stats.reset()
    assert torch.equal(generate(model, dense_impl, ids), generate(model, "sdpa", ids))
    assert stats.pipeline_calls == 2 and stats.decode_calls == 14
    torch.testing.assert_close(logits(model, dense_impl, ids), logits(model, "sdpa", ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_prefill_on_a_cached_prefix_goes_through_the_pipeline(dense_impl, cache):
    # Two prefill chunks: the second (q_len 200) attends to a 300-token cache plus itself. A
    # static cache hands the attention all 640 slots: no mask for the first chunk (causal over
    # the first 300 slots), a causal mask with 140 unused slots for the second.
    model, ids = llama(seed=3), prompt(500, seed=3)
    stats = get_fpv2_attention(dense_impl).stats
    results = {}
    for impl in ("sdpa", dense_impl):
        model.set_attn_implementation(impl)
        stats.reset()
        past = transformers.StaticCache(config=model.config, max_cache_len=640) if cache == "static" else None
        with torch.no_grad():
            first = model(ids[:, :300], past_key_values=past, use_cache=True)
            results[impl] = model(ids[:, 300:], past_key_values=first.past_key_values, use_cache=True).logits
    assert stats.pipeline_calls == 4 and stats.pipeline_tokens == 1000 and stats.fallback_calls == 0
    torch.testing.assert_close(results[dense_impl], results["sdpa"], rtol=0, atol=1e-4)


def test_unpadded_batch_is_served_and_padded_batch_falls_back(dense_impl):
    model = llama(seed=4)
    ids = torch.cat([prompt(200, seed=5), prompt(200, seed=6)])
    stats = get_fpv2_attention(dense_impl).stats
    stats.reset()
    full = torch.ones_like(ids)
    out = logits(model, dense_impl, ids, attention_mask=full)
    assert stats.pipeline_calls == 2 and stats.pipeline_tokens == 800 and stats.fallback_calls == 0
    torch.testing.assert_close(out, logits(model, "sdpa", ids, attention_mask=full), rtol=0, atol=1e-4)
    # Left padding: the mask is not causal, every layer goes to sdpa with sdpa's own mask.
    padded = full.clone()
    padded[0, :37] = 0
    stats.reset()
    out = logits(model, dense_impl, ids, attention_mask=padded)
    assert stats.pipeline_calls == 0
    assert stats.fallbacks == {"attention mask with padding or a non-causal pattern": 2}
    assert torch.equal(out, logits(model, "sdpa", ids, attention_mask=padded))


def test_sparse_selection_prunes_and_stays_close_to_sdpa(sparse_impl):
    # A random model attends almost uniformly, so every block reaches alpha of the maximum
    # and nothing is pruned. Sharpened q/k projections and a prompt of 128-token runs of
    # one token give blocks that differ. Seen here (2 CPU cores, torch 2.13, transformers
    # 5.19): densities 0.951 and 0.958, logits rel. error 0.042 (0.081 with the correction
    # off), top-1 agreement 0.948 (0.877 with the correction off).
    model, ids = llama(sharpen=4.0), prompt(1024, run=128)
    stats = get_fpv2_attention(sparse_impl).stats
    stats.reset()
    ref = logits(model, "sdpa", ids)
    out = logits(model, sparse_impl, ids)
    assert stats.pipeline_calls == 2 and len(stats.densities) == 2
    assert all(0.5 < d < 1.0 for d in stats.densities), stats.densities
    err, top1 = rel_err(out, ref), float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    assert err < 0.1 and top1 > 0.9, (err, top1)
    # The mean correction is what keeps it close: the same selection without it is worse.
    plain = Fpv2Attention(SPARSE, correction=False)
    AttentionInterface.register("fpv2_test_plain", plain)
    AttentionMaskInterface.register("fpv2_test_plain", fpv2_mask)
    assert rel_err(logits(model, "fpv2_test_plain", ids), ref) > err


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_long_bf16_prefill_on_gpu_time_and_top1():
    # 16K tokens, bf16, head dim 128 (8 query heads over 2 KV heads), default backend. Dense
    # mode checks the plumbing at length; the default selection (alpha 0.1, 256 sink and 512
    # window tokens) shows time, density and top-1 agreement. q/k are sharpened 2x and the
    # prompt is made of 128-token runs, as in the CPU test, so that blocks differ at all.
    # Seen on an H200 (torch 2.11, transformers 5.17, Triton backend), whole 2-layer forward:
    # sdpa 5.8 ms; dense mode 22-31 ms, top-1 0.992, rel. error 0.005; sparse 9.7-12.8 ms,
    # densities 0.714 / 0.794, top-1 0.819, rel. error 0.127. A random model is a hard case for
    # pooled-key selection: each block repeats one token under RoPE, so its mean key says little
    # about its best key (with 4x sharpening: density 0.15, top-1 0.10).
    register_fpv2_attention(name="fpv2_test_gpu_dense", strategy="dense")
    register_fpv2_attention(name="fpv2_test_gpu")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=2048,
        vocab_size=1024,
        max_position_embeddings=32768,
    )
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(2.0)
            layer.self_attn.k_proj.weight.mul_(2.0)
    ids = prompt(16384, run=128, vocab=1024).cuda()

    def timed(impl: str) -> tuple[torch.Tensor, float, list[float]]:
        logits(model, impl, ids)  # warm-up: Triton compiles its kernels here
        calls = []
        remove = None
        if impl != "sdpa":
            attention = get_fpv2_attention(impl)
            attention.stats.reset()
            remove = attention.add_prefill_hook(lambda module, batch, result: calls.append((batch, result.index)))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = logits(model, impl, ids)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if remove is not None:
            remove()
            assert attention.stats.pipeline_calls == 2 and attention.stats.fallback_calls == 0
        return out, elapsed, [index.density(batch) for batch, index in calls]

    ref, t_sdpa, _ = timed("sdpa")
    report = [f"16K bf16 prefill, 2 layers: sdpa {t_sdpa * 1e3:.1f} ms"]
    measured = {}
    for impl in ("fpv2_test_gpu_dense", "fpv2_test_gpu"):
        out, elapsed, densities = timed(impl)
        top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
        measured[impl] = (top1, rel_err(out.float(), ref.float()), densities)
        report.append(
            f"{impl} ({get_fpv2_attention(impl).pipeline.backend.name}) {elapsed * 1e3:.1f} ms, densities "
            f"{[round(d, 3) for d in densities]}, top-1 agreement {top1:.4f}, logits rel. error {measured[impl][1]:.4f}"
        )
    print("\n" + "\n".join(report))
    top1, err, densities = measured["fpv2_test_gpu_dense"]
    assert densities == [1.0, 1.0] and top1 > 0.97 and err < 0.02
    top1, err, densities = measured["fpv2_test_gpu"]
    assert len(densities) == 2 and all(d < 0.95 for d in densities)
    assert top1 > 0.7 and err < 0.3
