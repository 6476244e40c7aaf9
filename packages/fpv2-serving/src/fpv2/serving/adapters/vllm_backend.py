"""The fpv2 attention backend for unmodified vLLM v1 (0.33), selected as ``--attention-backend CUSTOM``.

Usage: install ``fpv2-serving`` next to vLLM. Its ``vllm.general_plugins``
entry point (:func:`.vllm_plugin.register`) registers this class as vLLM's
``AttentionBackendEnum.CUSTOM`` in every vLLM process; then::

    vllm serve MODEL --attention-backend CUSTOM        # or attention_config={"backend": "CUSTOM"}

Prefill requests run fpv2's sparse prefill pipeline (pooling, max-threshold
block selection, mean correction, block-sparse attention) directly on vLLM's
paged KV cache; decode requests and the KV write run vLLM's own dense backend
(``FPV2_VLLM_DECODE_BACKEND``, default ``FLASH_ATTN`` on CUDA). Selection
parameters come from ``FPV2_VLLM_*`` variables (:mod:`.vllm_options`).

The pieces, one module each: :mod:`.vllm_options` (options),
:mod:`.vllm_metadata` (batch split and paged batch, no vLLM import),
:mod:`.vllm_kv_cache` (cache views and KV write, no vLLM import),
:mod:`.vllm_forward` (the split forward, no vLLM import),
:mod:`.vllm_decode` (the dense decode delegate), :mod:`.vllm_builder`
(metadata builder), :mod:`.vllm_impl` (impl), this module (backend class)
and :mod:`.vllm_plugin` (registration).

What has been exercised: vLLM 0.33.0's interface modules import on a CPU
machine (the wheel installed with ``--no-deps`` next to torch 2.13, plus
transformers, pydantic and a few light packages: psutil, cbor2, cachetools,
cloudpickle, uvloop, py-cpuinfo, prometheus_client, openai, openai-harmony,
sniffio, xgrammar, llguidance), and the tests build this
backend's metadata with vLLM's real ``CommonAttentionMetadata``,
``FullAttentionSpec``, ``VllmConfig`` and Triton metadata builder, register it
through vLLM's real registry, and run vLLM's real ``Attention`` layer with it
(``unified_kv_cache_update`` -> KV write, ``unified_attention_with_output`` ->
fpv2 prefill) on CPU tensors. Not exercised: vLLM's dense decode kernels
(vLLM disables Triton on a CPU-only machine, and its CUDA wheel cannot be
carried to the lent GPU), and any end-to-end engine run (``vllm serve``):
that needs vLLM's full dependency set and a GPU in one place.

Imports vLLM (``vllm.v1.attention``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType

from fpv2.kernel.contracts import SUPPORTED_HEAD_DIMS

from .vllm_builder import Fpv2MetadataBuilder
from .vllm_decode import default_decode_backend
from .vllm_impl import UNQUANTISED_KV_CACHE_DTYPES, Fpv2AttentionImpl

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheLayout

#: The ``AttentionBackendEnum`` member this backend is registered as (vLLM maps ``get_name()`` back to it).
BACKEND_NAME = "CUSTOM"


class Fpv2AttentionBackend(AttentionBackend):
    """vLLM v1 attention backend: fpv2 sparse prefill, vLLM dense decode (see the module docstring).

    What vLLM may pair with it is what both fpv2 and the decode backend serve:
    head sizes 64/128/256, fp16/bf16 (fp32 where the decode backend takes it),
    unquantised KV caches, causal decoder attention without sliding windows,
    sinks, ALiBi or soft-capping, the decode backend's block sizes and cache
    layouts. Context parallelism (PCP/DCP) is not supported.
    """

    # vLLM writes the cache through do_kv_cache_update() before forward().
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(UNQUANTISED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        """The registry name (vLLM looks the enum member up by it).

        Returns:
            ``"CUSTOM"``.
        """
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[Fpv2AttentionImpl]:
        """The per-layer impl class.

        Returns:
            :class:`~.vllm_impl.Fpv2AttentionImpl`.
        """
        return Fpv2AttentionImpl

    @staticmethod
    def get_builder_cls() -> type[Fpv2MetadataBuilder]:
        """The metadata builder class.

        Returns:
            :class:`~.vllm_builder.Fpv2MetadataBuilder`.
        """
        return Fpv2MetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        """Block sizes the decode backend's kernels take (fpv2 reads any page size).

        Args:
            kv_cache_spec: the layer's spec, passed on.

        Returns:
            The decode backend's list.
        """
        return default_decode_backend().get_supported_kernel_block_sizes(kv_cache_spec)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """Head sizes of the fpv2 kernels.

        Returns:
            ``[64, 128, 256]``.
        """
        return list(SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        """Whether fpv2 and the decode backend both take ``head_size``.

        Args:
            head_size: ``d``.

        Returns:
            The answer.
        """
        return head_size in SUPPORTED_HEAD_DIMS and default_decode_backend().supports_head_size(head_size)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        """Whether fpv2 and the decode backend both take activations of ``dtype``.

        Args:
            dtype: the model dtype.

        Returns:
            The answer.
        """
        return dtype in cls.supported_dtypes and default_decode_backend().supports_dtype(dtype)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Whether the decode backend takes ``block_size`` (fpv2 takes any).

        Args:
            block_size: vLLM's block size, or None.

        Returns:
            The answer.
        """
        return default_decode_backend().supports_block_size(block_size)

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        """Whether the decode backend runs on ``capability`` (fpv2 picks its own kernel per device).

        Args:
            capability: vLLM's ``DeviceCapability``.

        Returns:
            The answer.
        """
        return default_decode_backend().supports_compute_capability(capability)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: Any,
    ) -> str | None:
        """The decode backend's verdict on the combination, prefixed with its name.

        Args:
            head_size: ``d``.
            dtype: model dtype.
            kv_cache_dtype: vLLM's cache dtype string.
            block_size: vLLM's block size.
            use_mla: MLA model.
            has_sink: attention sinks.
            use_sparse: sparse MLA.
            use_mm_prefix: multimodal prefix masks.
            device_capability: the GPU's capability.

        Returns:
            None when the combination is fine, else the reason.
        """
        decode = default_decode_backend()
        reason = decode.supports_combination(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            use_mla,
            has_sink,
            use_sparse,
            use_mm_prefix,
            device_capability,
        )
        return None if reason is None else f"decode backend {decode.get_name()}: {reason}"

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...] | None:
        """The decode backend's cache layouts (the fpv2 kernels take any strides).

        Returns:
            The decode backend's answer.
        """
        return default_decode_backend().supported_kv_cache_layouts()

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        """Only causal decoder attention.

        Args:
            attn_type: vLLM's attention type.

        Returns:
            Whether it is ``AttentionType.DECODER``.
        """
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """The builder splits the batch on the CPU query offsets, so they must match the device ones.

        Returns:
            False.
        """
        return False
