"""The fpv2 SGLang prefill backend against SGLang 0.5.23's own classes, on CPU tensors.

Exercised, with SGLang's real code:

- registration: ``register_sglang_backend`` puts ``"fpv2"`` into SGLang's
  ``ATTENTION_BACKENDS`` registry and its command-line choices; SGLang's real
  ``ServerArgs.add_cli_args`` parser accepts ``--prefill-attention-backend fpv2``;
  the ``sglang.srt.plugins`` entry point is discovered and loaded by SGLang's own
  ``load_plugins_by_group`` (from a throw-away ``dist-info`` on ``sys.path``,
  since the wheel under test is not installed with its entry point);
- SGLang's own composition (``_build_resolved_backend``, what
  ``--prefill-attention-backend fpv2 --decode-attention-backend torch_native``
  runs) builds a ``HybridAttnBackend`` whose extend batches reach fpv2 and whose
  decode batches reach SGLang's dense ``TorchNativeAttnBackend``;
- the backend subclasses SGLang's ``AttentionBackend`` and is driven through its
  ``forward`` dispatch with real ``ForwardBatch`` dataclasses (EXTEND / DECODE),
  a real ``ReqToTokenPool`` and a real ``MHATokenToKVPool`` on ``device="cpu"``
  (NHD layout, and HND through ``SGLANG_USE_HND_KVCACHE``), real
  ``RadixAttention`` layers, K/V written through the pool's ``set_kv_buffer``;
- metadata for two requests (one on a cached prefix) at page sizes 1 and 16,
  every field checked; outputs equal fpv2's dense reference and SGLang's own
  torch-native backend (dense strategy), close to them with sparse settings;
  the KV cache written at the right slots; decode refused; a tensor-parallel
  rank's layer with half the heads.

Not exercised: no SGLang server, scheduler, model runner or model runs here or
on the device machine (its wheels need CUDA builds and network access that the
machines lack); ``ModelRunner`` is replaced by a namespace holding the real
pools, and the published server config by SGLang's test helper
``override_server_args``. Not run: CUDA graphs, real multi-process tensor
parallelism, chunked prefill across forwards, the Triton/Hopper fpv2 kernels
(the CPU picks the PyTorch reference).

SGLang's ``sglang.srt.configs`` imports ``torchvision.transforms`` at module
level, and the PyPI torchvision wheels link CUDA libraries that the CPU torch
lacks. When ``import torchvision`` fails, an import-only stand-in serves it
while SGLang is imported (nothing of torchvision is called on the paths tested)
and is removed afterwards. The module is skipped when SGLang cannot be imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from types import SimpleNamespace

import pytest
import torch


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and its submodules as empty modules whose attributes are inert placeholders."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+fpv2-test-stand-in"

        class InterpolationMode(enum.Enum):
            NEAREST = "nearest"
            NEAREST_EXACT = "nearest-exact"
            BILINEAR = "bilinear"
            BICUBIC = "bicubic"
            BOX = "box"
            HAMMING = "hamming"
            LANCZOS = "lanczos"

        module.InterpolationMode = InterpolationMode

        def __getattr__(name, _module=spec.name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Placeholder(f"{_module}.{name}")

        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


class _Placeholder:
    """A torchvision attribute that may be referenced at import time but never used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} belongs to the torchvision stand-in of the SGLang tests")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")


def _purge_torchvision() -> None:
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]


def _import_sglang() -> types.SimpleNamespace:
    """Import the SGLang classes under test (with the torchvision stand-in if needed)."""
    stand_in = None
    try:
        import torchvision  # noqa: F401
    except Exception:
        _purge_torchvision()
        try:
            # Pin transformers' cached answer to the real one before the stand-in exists.
            from transformers.utils import import_utils

            import_utils.is_torchvision_available()
        except Exception:
            pass
        stand_in = _TorchvisionStandIn()
        sys.meta_path.insert(0, stand_in)
    try:
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
        from sglang.srt.layers.attention import attention_registry
        from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
        from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.model_executor.model_runner_components import attention_backend_setup
        from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
        from sglang.srt.runtime_context import get_context
        from sglang.srt.server_args import ServerArgs

        # set_kv_buffer imports this on first use: import it while the stand-in is present.
        importlib.import_module("sglang.srt.model_executor.runner")
    finally:
        if stand_in is not None:
            sys.meta_path.remove(stand_in)
            _purge_torchvision()
    return SimpleNamespace(
        ATTENTION_BACKEND_CHOICES=ATTENTION_BACKEND_CHOICES,
        attention_registry=attention_registry,
        AttentionBackend=AttentionBackend,
        HybridAttnBackend=HybridAttnBackend,
        TorchNativeAttnBackend=TorchNativeAttnBackend,
        RadixAttention=RadixAttention,
        KVWriteLoc=KVWriteLoc,
        MHATokenToKVPool=MHATokenToKVPool,
        ReqToTokenPool=ReqToTokenPool,
        ForwardBatch=ForwardBatch,
        ForwardMode=ForwardMode,
        attention_backend_setup=attention_backend_setup,
        GENERAL_PLUGINS_GROUP=GENERAL_PLUGINS_GROUP,
        load_plugins_by_group=load_plugins_by_group,
        get_context=get_context,
        ServerArgs=ServerArgs,
    )


try:
    sgl = _import_sglang()
except Exception as exc:  # any missing dependency of SGLang's interface modules
    pytest.skip(
        f"SGLang's interface modules cannot be imported here ({type(exc).__name__}: {exc})", allow_module_level=True
    )

from fpv2.index import SelectionConfig  # noqa: E402
from fpv2.kernel import PagedPrefillBatch  # noqa: E402
from fpv2.kernel.reference.attention import dense_attention  # noqa: E402
from fpv2.kernel.reference.paged import gather_kv  # noqa: E402
from fpv2.kernel.testing import planted_workload  # noqa: E402
from fpv2.serving.adapters.sglang_backend import DECODE_REFUSAL, Fpv2AttnBackend  # noqa: E402
from fpv2.serving.adapters.sglang_kv_view import paged_cache_view  # noqa: E402
from fpv2.serving.adapters.sglang_metadata import (  # noqa: E402
    NO_PAGE,
    chunk_requests_of,
    page_table_from_req_to_token,
)
from fpv2.serving.adapters.sglang_options import SGLangBackendOptions  # noqa: E402
from fpv2.serving.adapters.sglang_plugin import BACKEND_NAME, register, register_sglang_backend  # noqa: E402
from fpv2.serving.chunked import ChunkedPrefillPipeline  # noqa: E402

DENSE = SGLangBackendOptions(strategy="dense", correction=False, backend="reference")
HEAD_DIM = 64
ROWS = (3, 1)  # request rows of ReqToTokenPool, not in batch order (row 0 is SGLang's padding row)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module", autouse=True)
def published_config():
    """SGLang's dummy published config (HybridAttnBackend reads the speculative settings from it)."""
    override = sgl.get_context().override_server_args(
        attention_backend="torch_native",
        prefill_attention_backend=BACKEND_NAME,
        decode_attention_backend="torch_native",
        tp_size=1,
        dp_size=1,
        pp_size=1,
        speculative_algorithm=None,
        kv_cache_dtype="auto",
    )
    server_args = override.install()
    yield server_args
    override.restore()


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_sglang_backend()
    return BACKEND_NAME


# --------------------------------------------------------------------------- scenario
@dataclasses.dataclass
class Scenario:
    """Two (or more) requests in SGLang's pools, the layers' tensors, and what an engine would hold."""

    runner: SimpleNamespace
    layers: list
    q_lens: list[int]
    prefix_lens: list[int]
    seq_lens: list[int]
    slots: list[torch.Tensor]  # per request, the pool slot of each token
    pages: list[list[int]]  # per request, its page ids in order
    q: list[torch.Tensor]  # per layer, (total_q, Hq, d)
    k_full: list[list[torch.Tensor]]  # per layer, per request, (seq_len, Hkv, d)
    v_full: list[list[torch.Tensor]]

    @property
    def page_size(self) -> int:
        return self.runner.token_to_kv_pool.page_size

    def new_slots(self) -> torch.Tensor:
        return torch.cat([s[p:] for s, p in zip(self.slots, self.prefix_lens)])

    def new_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        ks = [k[p:] for k, p in zip(self.k_full[layer], self.prefix_lens)]
        vs = [v[p:] for v, p in zip(self.v_full[layer], self.prefix_lens)]
        return torch.cat(ks), torch.cat(vs)

    def extend_batch(self, mode=None):
        return sgl.ForwardBatch(
            forward_mode=mode or sgl.ForwardMode.EXTEND,
            batch_size=len(self.q_lens),
            input_ids=torch.zeros(sum(self.q_lens), dtype=torch.long),
            req_pool_indices=torch.tensor(ROWS[: len(self.q_lens)], dtype=torch.long),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.long),
            out_cache_loc=self.new_slots(),
            seq_lens_sum=sum(self.seq_lens),
            seq_lens_cpu=torch.tensor(self.seq_lens, dtype=torch.long),
            positions=torch.cat([torch.arange(p, s) for p, s in zip(self.prefix_lens, self.seq_lens)]),
            extend_num_tokens=sum(self.q_lens),
            extend_seq_lens=torch.tensor(self.q_lens, dtype=torch.int32),
            extend_prefix_lens=torch.tensor(self.prefix_lens, dtype=torch.int32),
            extend_start_loc=torch.tensor([0, *torch.tensor(self.q_lens).cumsum(0)[:-1].tolist()], dtype=torch.int32),
            extend_seq_lens_cpu=list(self.q_lens),
            extend_prefix_lens_cpu=list(self.prefix_lens),
        )

    def reference(self, layer: int, heads: slice | None = None) -> torch.Tensor:
        """fpv2's dense reference on the requests' tokens, laid out contiguously (no page table involved)."""
        batch = PagedPrefillBatch.contiguous(self.q_lens, self.seq_lens, page_size=1)
        k = torch.cat(self.k_full[layer])[:, None]
        v = torch.cat(self.v_full[layer])[:, None]
        return dense_attention(self.q[layer], k, v, batch, softmax_scale=self.layers[layer].scaling)


def make_runner(page_size, num_kv_heads, num_pool_pages, layers=2, max_context_len=2048, dtype=torch.float32):
    pool = sgl.MHATokenToKVPool(
        size=num_pool_pages * page_size,
        page_size=page_size,
        dtype=dtype,
        head_num=num_kv_heads,
        head_dim=HEAD_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    req = sgl.ReqToTokenPool(size=4, max_context_len=max_context_len, device="cpu", enable_memory_saver=False)
    hf = SimpleNamespace(architectures=["LlamaForCausalLM"], hidden_size=512, num_attention_heads=8)
    hf.get_text_config = lambda: hf
    model_config = SimpleNamespace(
        context_len=max_context_len,
        hf_config=hf,
        hf_text_config=hf,
        quantization=None,
        is_draft_model=False,
        linear_attn_registry_result=None,
    )
    return SimpleNamespace(
        device="cpu",
        kv_cache_dtype=dtype,
        token_to_kv_pool=pool,
        req_to_token_pool=req,
        kv_index_translator=None,
        model_config=model_config,
        use_mla_backend=False,
        init_new_workspace=False,
    )


def make_scenario(
    page_size,
    q_lens=(300, 180),
    prefix_lens=(0, 200),
    *,
    num_q_heads=4,
    num_kv_heads=2,
    layers=2,
    tokens=None,
    seed=0,
):
    """Requests in SGLang's pools: shuffled pages, the prefix K/V already written (an earlier forward's work).

    ``tokens(layer, b)`` may supply ``(q_new, k_full, v_full)`` of request ``b``; random otherwise.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens)]
    needed = [-(-s // page_size) for s in seq_lens]
    num_pool_pages = sum(needed) + 5
    runner = make_runner(page_size, num_kv_heads, num_pool_pages, layers=layers)
    # Page 0 is SGLang's padding page; real pages are 1..num_pool_pages, handed out in shuffled order.
    free = (torch.randperm(num_pool_pages, generator=gen) + 1).tolist()
    pages, slots = [], []
    for b, s in enumerate(seq_lens):
        own, free = free[: needed[b]], free[needed[b] :]
        pos = torch.arange(s)
        pages.append(own)
        slots.append(torch.tensor(own)[pos // page_size] * page_size + pos % page_size)
        runner.req_to_token_pool.req_to_token[ROWS[b], :s] = slots[-1].to(torch.int32)
    layer_objs, qs, k_full, v_full = [], [], [], []
    for lid in range(layers):
        layer = sgl.RadixAttention(
            num_heads=num_q_heads,
            head_dim=HEAD_DIM,
            scaling=HEAD_DIM**-0.5 * (1.0 + 0.25 * lid),
            num_kv_heads=num_kv_heads,
            layer_id=lid,
        )
        layer_objs.append(layer)
        q_parts, ks, vs = [], [], []
        for b, (ql, s) in enumerate(zip(q_lens, seq_lens)):
            if tokens is not None:
                qb, kb, vb = tokens(lid, b)
            else:
                qb = torch.randn(ql, num_q_heads, HEAD_DIM, generator=gen)
                kb = torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen)
                vb = torch.randn(s, num_kv_heads, HEAD_DIM, generator=gen)
            q_parts.append(qb)
            ks.append(kb)
            vs.append(vb)
            p = prefix_lens[b]
            if p:
                # The cached prefix, written by SGLang's own write path as an earlier forward would have.
                runner.token_to_kv_pool.set_kv_buffer(layer, sgl.KVWriteLoc(slots[b][:p]), kb[:p], vb[:p])
        qs.append(torch.cat(q_parts))
        k_full.append(ks)
        v_full.append(vs)
    return Scenario(runner, layer_objs, list(q_lens), list(prefix_lens), seq_lens, slots, pages, qs, k_full, v_full)


def run_layers(backend, scenario, forward_batch):
    """One forward: metadata once, then every layer through SGLang's AttentionBackend.forward dispatch."""
    backend.init_forward_metadata(forward_batch)
    outs = []
    for lid, layer in enumerate(scenario.layers):
        k_new, v_new = scenario.new_kv(lid)
        q2d = scenario.q[lid].reshape(sum(scenario.q_lens), -1)
        outs.append(backend.forward(q2d, k_new, v_new, layer, forward_batch))
    return outs


# ----------------------------------------------------------------------- registration
def test_registry_resolves_fpv2_to_our_backend(registered):
    factory = sgl.attention_registry.ATTENTION_BACKENDS[registered]
    runner = make_runner(page_size=1, num_kv_heads=2, num_pool_pages=64)
    backend = factory(runner)
    assert type(backend) is Fpv2AttnBackend
    assert isinstance(backend, sgl.AttentionBackend)
    assert backend.req_to_token_pool is runner.req_to_token_pool
    assert backend.token_to_kv_pool is runner.token_to_kv_pool
    # SGLang's real parser accepts the name for the prefill (and only for the prefill) side.
    parser = argparse.ArgumentParser()
    sgl.ServerArgs.add_cli_args(parser)
    args = parser.parse_args(
        ["--model-path", "m", "--prefill-attention-backend", "fpv2", "--decode-attention-backend", "triton"]
    )
    assert (args.prefill_attention_backend, args.decode_attention_backend) == ("fpv2", "triton")
    # Re-registering keeps one choice; shadowing one of SGLang's backends is refused.
    register_sglang_backend()
    assert sgl.ATTENTION_BACKEND_CHOICES.count(registered) == 1
    with pytest.raises(ValueError, match="already has an attention backend named 'triton'"):
        register_sglang_backend("triton")
    with pytest.raises(TypeError, match="SGLangBackendOptions"):
        register_sglang_backend("fpv2_x", options={"alpha": 0.2})


def test_registered_options_reach_the_backend():
    try:
        register_sglang_backend("fpv2_dense", options=DENSE)
        backend = sgl.attention_registry.ATTENTION_BACKENDS["fpv2_dense"](
            make_runner(page_size=1, num_kv_heads=2, num_pool_pages=8)
        )
        assert backend.options is DENSE
    finally:
        sgl.attention_registry.ATTENTION_BACKENDS.pop("fpv2_dense", None)
        if "fpv2_dense" in sgl.ATTENTION_BACKEND_CHOICES:
            sgl.ATTENTION_BACKEND_CHOICES.remove("fpv2_dense")


def _wheel_declares_sglang_plugin() -> bool:
    from importlib import metadata

    try:
        eps = metadata.distribution("fpv2-serving").entry_points
    except metadata.PackageNotFoundError:
        return False
    return any(ep.group == sgl.GENERAL_PLUGINS_GROUP and ep.name == "fpv2" for ep in eps)


def test_plugin_entry_point_is_loaded_by_sglang(tmp_path, monkeypatch):
    # A dist-info that declares the entry point the fpv2-serving wheel declares.
    dist = tmp_path / "fpv2_sglang_probe-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fpv2-sglang-probe\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{sgl.GENERAL_PLUGINS_GROUP}]\nfpv2 = fpv2.serving.adapters.sglang_plugin:register\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    # As in a fresh SGLang process: no "fpv2" anywhere until the plugin runs.
    monkeypatch.delitem(sgl.attention_registry.ATTENTION_BACKENDS, "fpv2")
    choices = sgl.ATTENTION_BACKEND_CHOICES
    saved = list(choices)
    choices.remove("fpv2")
    try:
        plugins = sgl.load_plugins_by_group(sgl.GENERAL_PLUGINS_GROUP)
        assert plugins["fpv2"][0] is register
        # The installed fpv2-serving wheel declares the same entry point; it wins when present.
        assert plugins["fpv2"][1] == ("fpv2-serving" if _wheel_declares_sglang_plugin() else "fpv2-sglang-probe")
        assert "fpv2" not in sgl.attention_registry.ATTENTION_BACKENDS
        plugins["fpv2"][0]()  # what load_plugins() does with it
        assert getattr(sgl.attention_registry.ATTENTION_BACKENDS["fpv2"], "__fpv2_sglang_factory__", False)
        assert choices.count("fpv2") == 1
    finally:
        choices[:] = saved


# ---------------------------------------------------------------------------- metadata
@pytest.mark.parametrize("page_size", [1, 16])
def test_metadata_from_forward_batch(page_size):
    sc = make_scenario(page_size)
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    backend.init_forward_metadata(sc.extend_batch())
    meta = backend.forward_metadata
    batch = meta.batch
    assert batch.cu_seqlens_q.dtype == batch.seqlens_k.dtype == batch.page_table.dtype == torch.int32
    assert batch.cu_seqlens_q.tolist() == [0, 300, 480]
    assert batch.seqlens_k.tolist() == [300, 380]
    assert meta.prefix.dtype == torch.int32 and meta.prefix.tolist() == [0, 200]
    assert batch.prefix.tolist() == [0, 200]
    assert meta.forward_mode == sgl.ForwardMode.EXTEND
    assert batch.page_size == page_size
    pool = sc.runner.token_to_kv_pool
    assert batch.num_pages == (pool.size + page_size) // page_size
    needed = [-(-s // page_size) for s in sc.seq_lens]
    assert batch.page_table.shape == (2, max(needed))
    for b in range(2):
        row = batch.page_table[b].tolist()
        assert row[: needed[b]] == sc.pages[b]
        assert all(p == NO_PAGE for p in row[needed[b] :])
        # Slot by slot, the page table reproduces req_to_token.
        pos = torch.arange(sc.seq_lens[b])
        rebuilt = batch.page_table[b].long()[pos // page_size] * page_size + pos % page_size
        assert torch.equal(rebuilt, sc.runner.req_to_token_pool.req_to_token[ROWS[b], : sc.seq_lens[b]].long())


def test_page_table_sizes_from_host_lengths_and_refuses_bad_input():
    req_to_token = torch.arange(4 * 64, dtype=torch.int32).reshape(4, 64)
    table = page_table_from_req_to_token(
        req_to_token, torch.tensor([2]), torch.tensor([33]), page_size=16, max_seq_len=40
    )
    assert table.tolist() == [[(2 * 64) // 16, (2 * 64 + 16) // 16, (2 * 64 + 32) // 16]]
    with pytest.raises(ValueError, match="max_seq_len"):
        page_table_from_req_to_token(req_to_token, torch.tensor([2]), torch.tensor([33]), page_size=16, max_seq_len=65)
    with pytest.raises(ValueError, match="page_size"):
        page_table_from_req_to_token(req_to_token, torch.tensor([2]), torch.tensor([33]), page_size=0, max_seq_len=33)


def test_inconsistent_lengths_are_refused():
    sc = make_scenario(1)
    fb = sc.extend_batch()
    fb.extend_prefix_lens = torch.tensor([0, 199], dtype=torch.int32)
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=380 != extend_prefix_lens\[1\]=199"):
        backend.init_forward_metadata(fb)


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("page_size,hnd", [(1, False), (16, False), (16, True), (128, False)])
def test_forward_extend_dense_equals_references_and_writes_kv(page_size, hnd, monkeypatch):
    if hnd:
        monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    sc = make_scenario(page_size)
    pool = sc.runner.token_to_kv_pool
    assert pool.kv_cache_layout == ("hnd" if hnd else "nhd")
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    seen = []
    backend.result_hook = lambda lid, meta, result: seen.append((lid, meta, result))
    fb = sc.extend_batch()
    outs = run_layers(backend, sc, fb)
    # One metadata object for the forward, handed to every layer.
    assert [lid for lid, _, _ in seen] == [0, 1]
    assert seen[0][1] is seen[1][1] is backend.forward_metadata
    new_slots = sc.new_slots()
    for lid, out in enumerate(outs):
        assert out.shape == (480, 4 * HEAD_DIM) and out.dtype == torch.float32
        ref = sc.reference(lid).reshape(480, -1)
        # fp32 along two summation orders: a 7e-5 outlier was seen in about one run in three.
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert seen[lid][2].index.density(seen[lid][1].batch) == pytest.approx(1.0)
        # The new K/V sit at out_cache_loc, the prefix where it was, and nothing else was touched.
        k_new, v_new = sc.new_kv(lid)
        k_view = paged_cache_view(pool.get_key_buffer(lid), page_size=page_size, num_kv_heads=2, head_dim=HEAD_DIM)
        v_view = paged_cache_view(pool.get_value_buffer(lid), page_size=page_size, num_kv_heads=2, head_dim=HEAD_DIM)
        assert torch.equal(k_view[new_slots // page_size, new_slots % page_size], k_new)
        assert torch.equal(v_view[new_slots // page_size, new_slots % page_size], v_new)
        prefix_slots = sc.slots[1][:200]
        assert torch.equal(k_view[prefix_slots // page_size, prefix_slots % page_size], sc.k_full[lid][1][:200])
        written = k_view.reshape(-1, 2 * HEAD_DIM).abs().sum(dim=1) > 0
        assert int(written.sum()) == sum(sc.seq_lens)
    if not hnd:
        # SGLang's own dense backend on the same pool and batch (its slot-indexed read needs NHD).
        native = sgl.TorchNativeAttnBackend(sc.runner)
        native.init_forward_metadata(fb)
        for lid, layer in enumerate(sc.layers):
            q2d = sc.q[lid].reshape(480, -1)
            theirs = native.forward_extend(q2d, None, None, layer, fb, save_kv_cache=False)
            # Two fp32 implementations, two summation orders: the tolerance of the reference check above (a
            # 7.4e-5 difference at 1e-5 was seen once, on the 2-core CI machine under load, 2026-12-03).
            torch.testing.assert_close(outs[lid], theirs, rtol=1e-4, atol=1e-4)


def test_mixed_batch_with_a_decode_row():
    # Chunked prefill mixes a running request's one new token into an extend batch (ForwardMode.MIXED).
    sc = make_scenario(16, q_lens=(300, 1), prefix_lens=(0, 200), layers=1)
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    (out,) = run_layers(backend, sc, sc.extend_batch(sgl.ForwardMode.MIXED))
    assert backend.forward_metadata.batch.cu_seqlens_q.tolist() == [0, 300, 301]
    torch.testing.assert_close(out, sc.reference(0).reshape(301, -1), rtol=1e-5, atol=1e-5)


def test_forward_extend_sparse_settings_are_close_to_dense(monkeypatch):
    # Planted structure (so selection is meaningful), default alpha, strategy and correction;
    # sinks and windows shortened so that 2K-token CPU prompts have blocks to prune.
    wl = planted_workload(
        [2048, 1024], [2048, 2048], num_q_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, fraction=0.05, seed=5,
        dtype=torch.float32,
    )  # fmt: skip
    q_starts = wl.batch.host.cu_seqlens_q

    def tokens(layer, b):
        return (
            wl.q[q_starts[b] : q_starts[b + 1]],
            gather_kv(wl.k_cache, wl.batch, b),
            gather_kv(wl.v_cache, wl.batch, b),
        )

    for name, value in {"FPV2_SINK_TOKENS": "128", "FPV2_WINDOW_TOKENS": "128", "FPV2_MIN_SPARSE_KV_LEN": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FPV2_BACKEND", "reference")
    sc = make_scenario(16, q_lens=(2048, 1024), prefix_lens=(0, 1024), layers=1, tokens=tokens)
    sc.layers[0].scaling = HEAD_DIM**-0.5  # the planted margins assume the standard scale
    backend = Fpv2AttnBackend(sc.runner)  # options from the environment
    assert backend.options.strategy == "max_threshold" and backend.options.correction
    assert backend.options.selection.alpha == SelectionConfig().alpha
    seen = []
    backend.result_hook = lambda lid, meta, result: seen.append(result.index.density(meta.batch))
    (out,) = run_layers(backend, sc, sc.extend_batch())
    ref = sc.reference(0).reshape(out.shape)
    assert 0.0 < seen[0] < 0.8
    assert rel_err(out, ref) < 0.02  # measured 0.007 at density 0.55


def test_tensor_parallel_rank_runs_on_its_local_heads():
    # Global model: 8 query heads over 4 KV heads. Each rank of TP=2 holds 4 query and 2 KV heads.
    gen = torch.Generator().manual_seed(11)
    q_lens, prefix_lens = (200, 150), (0, 100)
    seq_lens = [q + p for q, p in zip(q_lens, prefix_lens)]
    q_global = [torch.randn(n, 8, HEAD_DIM, generator=gen) for n in q_lens]
    k_global = [torch.randn(s, 4, HEAD_DIM, generator=gen) for s in seq_lens]
    v_global = [torch.randn(s, 4, HEAD_DIM, generator=gen) for s in seq_lens]
    batch = PagedPrefillBatch.contiguous(list(q_lens), seq_lens, page_size=1)
    full = dense_attention(
        torch.cat(q_global), torch.cat(k_global)[:, None], torch.cat(v_global)[:, None], batch, softmax_scale=0.125
    )
    for rank in range(2):
        qh, kh = slice(4 * rank, 4 * rank + 4), slice(2 * rank, 2 * rank + 2)

        def tokens(layer, b, qh=qh, kh=kh):
            return q_global[b][:, qh], k_global[b][:, kh], v_global[b][:, kh]

        sc = make_scenario(16, q_lens, prefix_lens, num_q_heads=4, num_kv_heads=2, layers=1, tokens=tokens)
        layer = sc.layers[0]
        assert (layer.tp_q_head_num, layer.tp_k_head_num) == (4, 2)
        layer.scaling = 0.125
        (out,) = run_layers(Fpv2AttnBackend(sc.runner, options=DENSE), sc, sc.extend_batch())
        torch.testing.assert_close(out, full[:, qh].reshape(out.shape), rtol=1e-5, atol=1e-5)


def test_global_head_count_is_refused_on_a_rank():
    sc = make_scenario(1, layers=1)
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    fb = sc.extend_batch()
    backend.init_forward_metadata(fb)
    wrong = sgl.RadixAttention(num_heads=8, head_dim=HEAD_DIM, scaling=0.125, num_kv_heads=4, layer_id=0)
    with pytest.raises(ValueError, match="tp_k_head_num=4"):
        backend.forward(torch.zeros(480, 8 * HEAD_DIM), None, None, wrong, fb, save_kv_cache=False)


# --------------------------------------------------------------------- decode / hybrid
def test_decode_is_refused():
    sc = make_scenario(1, layers=1)
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    decode = sc.extend_batch(sgl.ForwardMode.DECODE)
    with pytest.raises(NotImplementedError, match="prefill-only") as info:
        backend.init_forward_metadata(decode)
    assert str(info.value) == DECODE_REFUSAL and "--decode-attention-backend" in DECODE_REFUSAL
    with pytest.raises(NotImplementedError, match="prefill-only"):
        backend.forward(torch.zeros(2, 4 * HEAD_DIM), None, None, sc.layers[0], decode, save_kv_cache=False)
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY"):
        backend.init_forward_metadata(sc.extend_batch(sgl.ForwardMode.TARGET_VERIFY))
    with pytest.raises(NotImplementedError, match="CUDA graph"):
        backend.init_cuda_graph_state(8, 64)


def test_sglang_hybrid_backend_routes_prefill_to_fpv2_and_decode_to_dense(registered):
    sc = make_scenario(16, layers=1)
    resolved = sgl.attention_backend_setup.ResolvedAttentionBackendStr(prefill=registered, decode="torch_native")
    hybrid = sgl.attention_backend_setup._build_resolved_backend(
        model_runner=sc.runner, resolved=resolved, init_new_workspace=False
    )
    assert isinstance(hybrid, sgl.HybridAttnBackend)
    assert type(hybrid.prefill_backend) is Fpv2AttnBackend
    assert type(hybrid.decode_backend) is sgl.TorchNativeAttnBackend
    # Prefill: the hybrid dispatches the extend batch to fpv2.
    layer = sc.layers[0]
    fb = sc.extend_batch()
    hybrid.init_forward_metadata(fb)
    k_new, v_new = sc.new_kv(0)
    out = hybrid.forward(sc.q[0].reshape(480, -1), k_new, v_new, layer, fb)
    torch.testing.assert_close(out, sc.reference(0).reshape(480, -1), rtol=1e-4, atol=1e-4)
    assert hybrid.prefill_backend.forward_metadata is not None
    # Decode: one new token per request on the dense backend, over the cache fpv2 wrote.
    gen = torch.Generator().manual_seed(2)
    tail_page = [sc.pages[b][-1] for b in range(2)]
    new_slot = torch.tensor([tail_page[b] * 16 + sc.seq_lens[b] % 16 for b in range(2)])
    assert all(sc.seq_lens[b] % 16 != 0 for b in range(2))  # the next token still fits the request's last page
    for b in range(2):
        sc.runner.req_to_token_pool.req_to_token[ROWS[b], sc.seq_lens[b]] = int(new_slot[b])
    q_dec = torch.randn(2, 4, HEAD_DIM, generator=gen)
    k_dec = torch.randn(2, 2, HEAD_DIM, generator=gen)
    v_dec = torch.randn(2, 2, HEAD_DIM, generator=gen)
    lens = [s + 1 for s in sc.seq_lens]
    decode = sgl.ForwardBatch(
        forward_mode=sgl.ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.zeros(2, dtype=torch.long),
        req_pool_indices=torch.tensor(ROWS[:2]),
        seq_lens=torch.tensor(lens),
        out_cache_loc=new_slot,
        seq_lens_sum=sum(lens),
        seq_lens_cpu=torch.tensor(lens),
    )
    hybrid.init_forward_metadata(decode)
    out = hybrid.forward(q_dec.reshape(2, -1), k_dec, v_dec, layer, decode)
    for b in range(2):
        k_all = torch.cat([sc.k_full[0][b], k_dec[b : b + 1]])
        v_all = torch.cat([sc.v_full[0][b], v_dec[b : b + 1]])
        logits = torch.einsum("hd,khd->hk", q_dec[b], k_all.repeat_interleave(2, dim=1)) * layer.scaling
        expected = torch.einsum("hk,khd->hd", logits.softmax(-1), v_all.repeat_interleave(2, dim=1))
        torch.testing.assert_close(out[b].reshape(4, HEAD_DIM), expected, rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------- refused features
@pytest.mark.parametrize(
    "change,match",
    [
        ({"logit_cap": 30.0}, "soft-capping"),
        ({"sliding_window_size": 128}, "sliding-window"),
        ({"is_cross_attention": True}, "cross attention"),
        ({"v_head_dim": 32}, "v_head_dim"),
    ],
)
def test_unsupported_layers_are_refused_before_writing(change, match):
    sc = make_scenario(1, layers=1)
    layer = sc.layers[0]
    for name, value in change.items():
        setattr(layer, name, value)
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    fb = sc.extend_batch()
    backend.init_forward_metadata(fb)
    before = sc.runner.token_to_kv_pool.get_key_buffer(0).clone()
    k_new, v_new = sc.new_kv(0)
    with pytest.raises(NotImplementedError, match=match):
        backend.forward(sc.q[0].reshape(480, -1), k_new, v_new, layer, fb)
    assert torch.equal(sc.runner.token_to_kv_pool.get_key_buffer(0), before)


def test_kv_cache_in_another_dtype_and_extra_arguments_are_refused():
    sc = make_scenario(1, layers=1)
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    fb = sc.extend_batch()
    backend.init_forward_metadata(fb)
    layer = sc.layers[0]
    k_new, v_new = sc.new_kv(0)
    with pytest.raises(NotImplementedError, match="KV cache in torch.float32"):
        backend.forward(sc.q[0].reshape(480, -1).half(), k_new.half(), v_new.half(), layer, fb)
    with pytest.raises(NotImplementedError, match="sinks"):
        backend.forward(sc.q[0].reshape(480, -1), k_new, v_new, layer, fb, sinks=torch.zeros(4))
    mla_runner = make_runner(page_size=1, num_kv_heads=2, num_pool_pages=8)
    mla_runner.use_mla_backend = True
    with pytest.raises(ValueError, match="MLA"):
        Fpv2AttnBackend(mla_runner, options=DENSE)


def test_forward_without_metadata_is_refused():
    sc = make_scenario(1, layers=1)
    backend = Fpv2AttnBackend(sc.runner, options=DENSE)
    with pytest.raises(RuntimeError, match="before init_forward_metadata"):
        backend.forward(sc.q[0].reshape(480, -1), None, None, sc.layers[0], sc.extend_batch(), save_kv_cache=False)


# ------------------------------------------------------------------------------ options
def test_options_from_environment():
    env = {
        "FPV2_ALPHA": "0.18",
        "FPV2_SINK_TOKENS": "512",
        "FPV2_WINDOW_TOKENS": "0",
        "FPV2_MIN_SPARSE_KV_LEN": "4096",
        "FPV2_PROBE_STRIDE": "2",
        "FPV2_STRATEGY": "dense",
        "FPV2_CORRECTION": "off",
        "FPV2_BACKEND": "reference",
        "FPV2_VALIDATE": "No",
    }
    opts = SGLangBackendOptions.from_env(env)
    assert opts.selection == SelectionConfig(
        alpha=0.18, sink_tokens=512, window_tokens=0, min_sparse_kv_len=4096, probe_stride=2
    )
    assert (opts.strategy, opts.correction, opts.backend, opts.validate) == ("dense", False, "reference", False)
    assert SGLangBackendOptions.from_env({}) == SGLangBackendOptions()
    assert opts.selection_for_scale(0.5).softmax_scale == 0.5
    with pytest.raises(ValueError, match=r"FPV2_ALPHA='1\.5'"):
        SGLangBackendOptions.from_env({"FPV2_ALPHA": "1.5"})
    with pytest.raises(ValueError, match="FPV2_BLOCK_SIZE='big'"):
        SGLangBackendOptions.from_env({"FPV2_BLOCK_SIZE": "big"})
    with pytest.raises(ValueError, match="FPV2_CORRECTION='maybe'"):
        SGLangBackendOptions.from_env({"FPV2_CORRECTION": "maybe"})
    with pytest.raises(ValueError, match="unknown selection strategy"):
        Fpv2AttnBackend(
            make_runner(page_size=1, num_kv_heads=2, num_pool_pages=8), options=SGLangBackendOptions(strategy="nope")
        )


# ----------------------------------------------------------------------- chunked prefill
def chunk_forward_batch(sc, begin, end, *, rid="req-0", prompt_len=None):
    """SGLang's ForwardBatch of one request's chunk ``begin:end`` (the scenario's request 0 holds the prompt)."""
    q_len = end - begin
    return sgl.ForwardBatch(
        forward_mode=sgl.ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.zeros(q_len, dtype=torch.long),
        req_pool_indices=torch.tensor(ROWS[:1], dtype=torch.long),
        seq_lens=torch.tensor([end], dtype=torch.long),
        out_cache_loc=sc.slots[0][begin:end],
        seq_lens_sum=end,
        seq_lens_cpu=torch.tensor([end], dtype=torch.long),
        positions=torch.arange(begin, end),
        extend_num_tokens=q_len,
        extend_seq_lens=torch.tensor([q_len], dtype=torch.int32),
        extend_prefix_lens=torch.tensor([begin], dtype=torch.int32),
        extend_start_loc=torch.tensor([0], dtype=torch.int32),
        extend_seq_lens_cpu=[q_len],
        extend_prefix_lens_cpu=[begin],
        orig_seq_lens=None if prompt_len is None else torch.tensor([prompt_len], dtype=torch.int32),
        rids=None if rid is None else [rid],
    )


def run_chunk_layers(backend, sc, begin, end, **batch_fields):
    """One forward of a chunk through every layer (SGLang's dispatch), the chunk's K/V written by the pool."""
    forward_batch = chunk_forward_batch(sc, begin, end, **batch_fields)
    backend.init_forward_metadata(forward_batch)
    outs = []
    for lid, layer in enumerate(sc.layers):
        k_new, v_new = sc.k_full[lid][0][begin:end], sc.v_full[lid][0][begin:end]
        q2d = sc.q[lid][begin:end].reshape(end - begin, -1)
        outs.append(backend.forward(q2d, k_new, v_new, layer, forward_batch))
    return outs


def planted_chunk_scenario(length, page_size=16):
    """One planted prompt of ``length`` tokens over two layers, nothing cached yet."""
    wl = planted_workload(
        [length], num_q_heads=4, num_kv_heads=2, head_dim=HEAD_DIM, fraction=0.05, seed=11, dtype=torch.float32
    )

    def tokens(layer, b):
        return wl.q, gather_kv(wl.k_cache, wl.batch, 0), gather_kv(wl.v_cache, wl.batch, 0)

    sc = make_scenario(page_size, q_lens=(length,), prefix_lens=(0,), layers=2, tokens=tokens)
    for layer in sc.layers:
        layer.scaling = HEAD_DIM**-0.5
    return sc, wl


CHUNK_OPTIONS = {
    "FPV2_SINK_TOKENS": "128",
    "FPV2_WINDOW_TOKENS": "128",
    "FPV2_MIN_SPARSE_KV_LEN": "0",
    "FPV2_BACKEND": "reference",
}


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_across_forwards_keeps_the_unchunked_selection(page_size, monkeypatch):
    """A 2048-token prompt in four SGLang forwards: each layer carries its state by the request id, each chunk
    pools only its own blocks, the dense tail is in the last chunk only, and the outputs are
    ChunkedPrefillPipeline.run's; the per-call path (FPV2_CHUNK_AWARE=0) keeps a dense tile in every chunk."""
    for name, value in CHUNK_OPTIONS.items():
        monkeypatch.setenv(name, value)
    length, size = 2048, 512
    sc, wl = planted_chunk_scenario(length, page_size)
    aware = Fpv2AttnBackend(sc.runner)
    assert aware.options.chunk_aware and aware.chunk_aware  # the default
    seen, pooled = [], []

    def hook(lid, meta, result):
        seen.append((lid, meta, result))
        state = aware.chunk_states.get("req-0", lid)
        pooled.append(None if state is None else state.pooled_blocks)

    aware.result_hook = hook
    outs = [run_chunk_layers(aware, sc, b, b + size, prompt_len=length) for b in range(0, length, size)]
    assert len(aware.chunk_states) == 0 and aware.chunk_states.counters.resumed == 2 * 3

    expected = ChunkedPrefillPipeline(
        aware.options.selection_for_scale(HEAD_DIM**-0.5), backend="reference", carry_tile_pages=False
    ).run(wl.q, wl.k_cache, wl.v_cache, wl.batch, chunk_size=size)
    block = aware.options.selection.block_size
    for i, (lid, meta, _) in enumerate(seen):
        chunk = i // 2
        assert meta.chunk_requests is not None and meta.chunk_requests[0].prompt_len == length
        torch.testing.assert_close(outs[chunk][lid].reshape(size, 4, HEAD_DIM), expected.chunks[chunk].out)
    # Each chunk pooled only its own blocks (the per-call pipeline pools the whole KV again every chunk);
    # the last chunk's state is released after its layer ran.
    assert pooled == [size // block * (i // 2 + 1) for i in range(6)] + [None, None]

    per_call = []
    for name, value in {**CHUNK_OPTIONS, "FPV2_CHUNK_AWARE": "0"}.items():
        monkeypatch.setenv(name, value)
    plain = Fpv2AttnBackend(sc.runner)
    plain.result_hook = lambda lid, meta, result: per_call.append((meta, result))
    for b in range(0, length, size):
        run_chunk_layers(plain, sc, b, b + size, prompt_len=length)
    assert all(meta.chunk_requests is None for meta, _ in per_call)
    kept_aware = [r.index.nnz for _, _, r in seen]
    kept_plain = [r.index.nnz for _, r in per_call]
    # The first three chunks: fewer kept blocks without their own dense tail; the last chunk: the same rule.
    assert all(a < p for a, p in zip(kept_aware[:6], kept_plain[:6]))
    assert kept_aware[6:] == kept_plain[6:]


def test_chunk_states_need_the_request_ids_and_survive_other_forwards(monkeypatch):
    for name, value in CHUNK_OPTIONS.items():
        monkeypatch.setenv(name, value)
    sc, _ = planted_chunk_scenario(1024)
    backend = Fpv2AttnBackend(sc.runner)
    run_chunk_layers(backend, sc, 0, 512, rid=None, prompt_len=1024)  # no rids: the per-call pipeline
    assert backend.forward_metadata.chunk_requests is None and len(backend.chunk_states) == 0
    padded = chunk_forward_batch(sc, 0, 512, prompt_len=1024)
    padded.rids = ["req-0", "pad"]  # ids that do not match the batch's rows: the per-call pipeline
    assert chunk_requests_of(padded) is None
    padded.extend_prefix_lens_cpu, padded.extend_seq_lens_cpu = [0, 0], [512, 0]
    padded.orig_seq_lens = torch.tensor([1024, 0], dtype=torch.int32)
    assert len(chunk_requests_of(padded)) == 2
    backend.init_forward_metadata(padded)  # two ids for a one-row batch
    assert backend.forward_metadata.chunk_requests is None and len(backend.chunk_states) == 0
    run_chunk_layers(backend, sc, 0, 512, prompt_len=1024)
    assert backend.chunk_states.requests() == ("req-0",) and len(backend.chunk_states) == 2
    # Another request's one-forward prefill in between runs per call and leaves the chunked request's states alone.
    run_chunk_layers(backend, sc, 0, 1024, rid="other", prompt_len=1024)
    assert backend.forward_metadata.chunk_requests is None and len(backend.chunk_states) == 2
    run_chunk_layers(backend, sc, 512, 1024, prompt_len=1024)
    assert len(backend.chunk_states) == 0 and backend.chunk_states.counters.resumed == 2
    # Without orig_seq_lens the states stay until the budget drops them (the request may go on).
    run_chunk_layers(backend, sc, 0, 512, rid="req-1")
    assert backend.chunk_states.requests() == ("req-1",)
    tight = Fpv2AttnBackend(sc.runner, options=dataclasses.replace(backend.options, chunk_state_mb=0))
    run_chunk_layers(tight, sc, 0, 512, rid="a", prompt_len=1024)
    run_chunk_layers(tight, sc, 0, 512, rid="b", prompt_len=1024)
    assert tight.chunk_states.requests() == ("b",) and tight.chunk_states.counters.evicted == 2


def test_chunk_options_from_environment():
    opts = SGLangBackendOptions.from_env({"FPV2_CHUNK_AWARE": "off", "FPV2_CHUNK_STATE_MB": "64"})
    assert (opts.chunk_aware, opts.chunk_state_mb) == (False, 64)
    with pytest.raises(ValueError, match="FPV2_CHUNK_STATE_MB='lots'"):
        SGLangBackendOptions.from_env({"FPV2_CHUNK_STATE_MB": "lots"})
    with pytest.raises(ValueError, match="FPV2_CHUNK_STATE_MB='-1'"):
        SGLangBackendOptions.from_env({"FPV2_CHUNK_STATE_MB": "-1"})
    # Chunk-aware by default whatever the attention backend (the Hopper kernel's per-call default is gone).
    assert SGLangBackendOptions.from_env({}).chunk_aware is True
    assert SGLangBackendOptions.from_env({"FPV2_BACKEND": "hopper"}).chunk_aware is True
    assert SGLangBackendOptions.from_env({"FPV2_CHUNK_AWARE": "0"}).chunk_aware is False
    for bad in (1, None):
        with pytest.raises(TypeError, match="chunk_aware"):
            SGLangBackendOptions(chunk_aware=bad)
