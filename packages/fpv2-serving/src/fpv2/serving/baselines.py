"""Dense baselines outside fpv2: PyTorch SDPA with the flash (FA2-class) and cuDNN backends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.reference.paged import gather_kv


@dataclass(frozen=True)
class Baseline:
    """A ready-to-time dense attention call and how it maps back to the packed layout."""

    impl: str  # stable impl name of the summary records
    dtype: torch.dtype
    call: Callable[[], torch.Tensor]  # returns (B, Hq, L, d)
    note: str

    def packed(self, out: torch.Tensor) -> torch.Tensor:
        """``(B, Hq, L, d)`` -> ``(B * L, Hq, d)`` packed like the fpv2 output.

        Args:
            out: the baseline's output.

        Returns:
            The packed output.
        """
        b, h, length, d = out.shape
        return out.transpose(1, 2).reshape(b * length, h, d)


def sdpa_baselines(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefillBatch
) -> tuple[list[Baseline], list[str]]:
    """Torch SDPA flash and cuDNN calls on contiguous copies of the inputs, where they can run.

    SDPA needs equal-length requests without a cached prefix and contiguous
    K/V, so the paged cache is gathered once here, outside any timed region.
    GQA uses SDPA's ``enable_gqa`` when the backend takes it, else K/V are
    expanded to ``Hq`` heads.

    Args:
        q: ``(B * L, Hq, d)`` bf16 or fp16 queries.
        k_cache: paged keys.
        v_cache: paged values.
        batch: the batch (equal lengths, no prefix).

    Returns:
        ``(baselines that ran a probe call successfully, notes on those skipped)``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    notes: list[str] = []
    host = batch.host
    if q.device.type != "cuda":
        return [], ["torch SDPA baselines: only timed on CUDA"]
    if q.dtype not in (torch.bfloat16, torch.float16):
        return [], [f"torch SDPA baselines: need bf16/fp16 inputs, got {q.dtype}"]
    if len(set(host.q_lens)) != 1 or any(host.prefix) or len(set(host.seqlens_k)) != 1:
        return [], ["torch SDPA baselines: need equal-length requests with no cached prefix"]
    nreq, length = batch.num_requests, host.q_lens[0]
    heads, d = q.shape[1], q.shape[2]
    qs = q.view(nreq, length, heads, d).transpose(1, 2).contiguous()
    ks = torch.stack([gather_kv(k_cache, batch, b) for b in range(nreq)]).transpose(1, 2).contiguous()
    vs = torch.stack([gather_kv(v_cache, batch, b) for b in range(nreq)]).transpose(1, 2).contiguous()
    group = heads // ks.shape[1]
    expanded: tuple[torch.Tensor, torch.Tensor] | None = None

    def make(backend: SDPBackend, gqa: bool) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            with sdpa_kernel(backend):
                if gqa:
                    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                assert expanded is not None
                return F.scaled_dot_product_attention(qs, expanded[0], expanded[1], is_causal=True)

        return call

    baselines = []
    for impl, backend in (
        ("torch-sdpa-flash", SDPBackend.FLASH_ATTENTION),
        ("torch-sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        chosen, note = None, ""
        for gqa in (True, False) if group > 1 else (False,):
            if not gqa and group > 1 and expanded is None:
                expanded = (ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1))
            call = make(backend, gqa)
            try:
                call()
                torch.cuda.synchronize(q.device)
            except RuntimeError as exc:
                note = f"{impl}: {'enable_gqa' if gqa else 'expanded K/V'} refused ({str(exc).splitlines()[0]})"
                continue
            chosen = call
            note = "GQA via enable_gqa" if gqa else ("K/V expanded to Hq heads" if group > 1 else "MHA")
            break
        if chosen is None:
            notes.append(f"{impl} skipped: {note}")
            continue
        baselines.append(Baseline(impl, q.dtype, chosen, note))
    return baselines, notes
