"""The metadata builder of the fpv2 vLLM backend: one :class:`Fpv2VllmMetadata` per step and KV cache group.

vLLM calls ``build`` once per step for each KV cache group and hands the
result to every attention layer of the group. The builder

* asks vLLM to put decode requests first (``reorder_batch_threshold``: one
  token, or ``1 + num_speculative_tokens`` with speculative decoding);
* splits the batch there (:func:`.vllm_metadata.split_decode_prefill`, vLLM's
  rule, on the CPU copy of the query offsets);
* builds the decode requests' metadata with the dense decode backend's own
  builder, on the decode slice of vLLM's common metadata;
* keeps the prefill requests' offsets, KV lengths and block-table rows for
  the fpv2 pipeline (:class:`.vllm_metadata.VllmPrefillPart`), with host
  copies from vLLM's CPU tensors so no layer synchronises to read them.

CUDA graphs: ``AttentionCGSupport.NEVER`` (vLLM then runs attention eagerly
between captured pieces). Full-graph decode through the delegate is not
claimed because it has not been run on a GPU engine.

Imports vLLM (``vllm.v1.attention``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata

from .vllm_decode import resolve_decode_backend
from .vllm_metadata import BatchSplit, Fpv2VllmMetadata, VllmPrefillPart, host_view_from_vllm, split_decode_prefill
from .vllm_options import VllmAdapterOptions, load_options


def decode_common_metadata(common: CommonAttentionMetadata, split: BatchSplit) -> CommonAttentionMetadata:
    """vLLM's common metadata of the decode requests alone (the leading ``split.num_decodes``).

    Args:
        common: the whole step's common metadata.
        split: where the decodes end.

    Returns:
        The decode slice: its first ``num_decodes`` requests and ``num_decode_tokens``
        tokens, with ``max_query_len`` of the decodes.
    """
    part = common.unpadded(split.num_decode_tokens, split.num_decodes)
    qsl = common.query_start_loc_cpu[: split.num_decodes + 1]
    return part.replace(max_query_len=int((qsl[1:] - qsl[:-1]).max()))


class Fpv2MetadataBuilder(AttentionMetadataBuilder[Fpv2VllmMetadata]):
    """Builds :class:`~.vllm_metadata.Fpv2VllmMetadata` from vLLM's ``CommonAttentionMetadata``.

    Args:
        kv_cache_spec: the group's KV cache spec (vLLM).
        layer_names: the group's attention layers.
        vllm_config: the engine configuration.
        device: device of the step's tensors.
        options: adapter options (None: :func:`.vllm_options.load_options`).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: torch.device,
        *,
        options: VllmAdapterOptions | None = None,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.options = load_options() if options is None else options
        decode_backend = resolve_decode_backend(self.options.decode_backend)
        self.decode_builder = decode_backend.get_builder_cls()(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes (and speculative verification rows) first, each at most this long.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> Fpv2VllmMetadata:
        """The step's metadata (see the module docstring).

        Args:
            common_prefix_len: deprecated by vLLM, always 0; ignored.
            common_attn_metadata: vLLM's per-step metadata.
            fast_build: passed to the decode builder.

        Returns:
            The :class:`~.vllm_metadata.Fpv2VllmMetadata`.
        """
        del common_prefix_len
        common = common_attn_metadata
        threshold = self.reorder_batch_threshold or 1
        split = split_decode_prefill(common.query_start_loc_cpu[: common.num_reqs + 1], threshold)
        decode = None
        if split.num_decodes:
            decode = self.decode_builder.build(
                common_prefix_len=0,
                common_attn_metadata=decode_common_metadata(common, split),
                fast_build=fast_build,
            )
        prefill = None
        if split.num_prefills:
            num_reqs = common.num_reqs
            prefill = VllmPrefillPart(
                query_start_loc=common.query_start_loc[: num_reqs + 1],
                seq_lens=common.seq_lens[:num_reqs],
                block_table=common.block_table_tensor[:num_reqs],
                first_prefill=split.num_decodes,
                host=host_view_from_vllm(
                    common.query_start_loc_cpu[: num_reqs + 1],
                    None if common.seq_lens_cpu_upper_bound is None else common.seq_lens_cpu_upper_bound[:num_reqs],
                    split.num_decodes,
                ),
                check_values=self.options.check_values,
            )
        return Fpv2VllmMetadata(
            split=split,
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping,
            prefill=prefill,
            decode=decode,
        )
