"""The pipeline hands a backend's tile-page copy to the pooling kernel, and the copy to the backend's run.

CPU runs use the Triton interpreter (``TRITON_INTERPRET=1``) for the pooling; the attention is the PyTorch
reference, run on the tile pages the pooling filled. The Hopper backend's own use of the copy runs on the device
(``test_serving_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.testing import planted_workload
from fpv2.serving import SparsePrefillPipeline
from fpv2.serving.backends import ReferenceBackend
from fpv2.serving.fallback_backend import FallbackBackend

SPARSE = SelectionConfig(alpha=0.1, sink_tokens=128, window_tokens=128, min_sparse_kv_len=0)


class TileCopyingBackend(ReferenceBackend):
    """The reference backend, run on tile pages it asks the pipeline to have filled (as the Hopper backend does)."""

    name = "tile-copying"

    def __init__(self, offer: bool = True, name: str = "tile-copying") -> None:
        self.name = name
        self.offer = offer
        self.offered = None
        self.received = None

    def serves(self, q, k_cache, batch, index):
        return None if self.offer else "declines"

    def tile_copies_for(self, q, k_cache, v_cache, batch):
        from fpv2.kernel.triton.tile_repack import allocate_tile_pages

        if not self.offer:
            return None
        self.offered = allocate_tile_pages(k_cache, v_cache, batch)
        for tiles in (self.offered.k_cache, self.offered.v_cache):
            tiles.fill_(float("nan"))  # a row the pooling does not write poisons the output
        return self.offered

    def run(self, q, k_cache, v_cache, batch, index, plan, *, tile_copies=None, **kwargs):
        self.received = tile_copies
        if tile_copies is not None:
            k_cache, v_cache, batch = tile_copies.k_cache, tile_copies.v_cache, tile_copies.batch
        return super().run(q, k_cache, v_cache, batch, index, plan, **kwargs)


@pytest.fixture
def triton_pooling(monkeypatch):
    """The Triton pooling on the CPU (the pipeline takes it for CUDA inputs only)."""
    pytest.importorskip("triton")
    from fpv2.index.triton import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 to run the Triton pooling on the CPU")
    monkeypatch.setattr("fpv2.serving.pipeline.use_triton_index", lambda q: True)


def _workload(page_size: int):
    return planted_workload(
        [300, 200], [500, 200], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size, dtype=torch.float32
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("correction", [True, False])
def test_the_backend_runs_on_the_copy_the_pooling_made(triton_pooling, page_size, correction):
    wl = _workload(page_size)
    backend = TileCopyingBackend()
    got = SparsePrefillPipeline(SPARSE, correction=correction, backend=backend)(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert backend.offered is not None and backend.received is backend.offered
    want = SparsePrefillPipeline(SPARSE, correction=correction, backend="reference")(
        wl.q, wl.k_cache, wl.v_cache, wl.batch
    )
    assert torch.isfinite(got.out).all()
    torch.testing.assert_close(got.out, want.out, rtol=1e-6, atol=1e-6)


def test_no_copy_is_asked_for_without_the_triton_pooling():
    wl = _workload(16)
    backend = TileCopyingBackend()
    SparsePrefillPipeline(SPARSE, backend=backend)(wl.q, wl.k_cache, wl.v_cache, wl.batch)  # CPU: reference pooling
    assert backend.offered is None and backend.received is None


def test_no_copy_is_asked_for_without_pooled_values(triton_pooling):
    wl = _workload(16)
    # The dense strategy without the correction pools keys only: nothing to copy V from.
    dense = TileCopyingBackend()
    dense.run_dense = None  # through run(), as a backend without a dense mode
    SparsePrefillPipeline(strategy="dense", correction=False, backend=dense)(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert dense.offered is None and dense.received is None


def test_a_backend_that_declines_gets_no_copy(triton_pooling):
    wl = _workload(16)
    backend = TileCopyingBackend(offer=False)
    SparsePrefillPipeline(SPARSE, backend=backend)(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert backend.received is None


def test_fallback_offers_the_primarys_copy_and_keeps_it_from_the_fallback(triton_pooling):
    wl = _workload(16)
    primary, fallback = TileCopyingBackend(name="primary"), TileCopyingBackend(name="fallback")
    backend = FallbackBackend(primary, fallback)
    SparsePrefillPipeline(SPARSE, backend=backend)(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert primary.received is primary.offered is not None and fallback.offered is None
    assert backend.last_choice == ("primary", None)
    # The primary offers a copy, then does not serve the call (its check runs again at run time).
    primary, fallback = TileCopyingBackend(name="primary"), TileCopyingBackend(name="fallback")
    primary.serves = lambda *args: "not this call"
    backend = FallbackBackend(primary, fallback)
    SparsePrefillPipeline(SPARSE, backend=backend)(wl.q, wl.k_cache, wl.v_cache, wl.batch)
    assert primary.offered is not None and primary.received is None
    assert fallback.received is None and backend.last_choice == ("fallback", "not this call")
