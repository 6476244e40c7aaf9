"""One call from a prefill batch to its block index."""

from __future__ import annotations

import torch

from fpv2.kernel.contracts import BlockIndex, BlockStatistics, PagedPrefillBatch, validate_prefill_inputs
from fpv2.kernel.reference.pooling import pool_blocks

from .config import SelectionConfig
from .strategies import SelectionStrategy, get_strategy


def build_block_index(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    config: SelectionConfig | None = None,
    strategy: str | SelectionStrategy = "max_threshold",
    statistics: BlockStatistics | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
) -> BlockIndex:
    """Select the kept key blocks of every (request, KV head, query tile) of a prefill batch.

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged key cache.
        batch: the paged prefill batch.
        config: selection parameters; ``None`` means :class:`SelectionConfig` defaults.
        strategy: a registered strategy name (see :func:`available_strategies`) or a strategy instance.
        statistics: pooled keys of the batch, pooled with ``config.block_size``. When
            None they are pooled here from ``k_cache`` (with ``k_descale``); pass them
            to share one pooling with the mean correction.
        q_descale: ``(B, Hkv) float32`` query descales, required for FP8 inputs.
        k_descale: ``(B, Hkv) float32`` key descales, required for FP8 inputs.

    Returns:
        The block index, with ``tile_size`` and ``block_size`` from ``config``.

    Raises:
        TypeError, ValueError: bad inputs, naming the argument, its shape and dtype;
            an unknown strategy name (the message lists the available ones).
    """
    return _build_block_index(
        q,
        k_cache,
        batch,
        config=config,
        strategy=strategy,
        statistics=statistics,
        q_descale=q_descale,
        k_descale=k_descale,
        inputs_validated=False,
    )


def _build_block_index(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    *,
    config: SelectionConfig | None,
    strategy: str | SelectionStrategy,
    statistics: BlockStatistics | None,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    inputs_validated: bool,
) -> BlockIndex:
    """:func:`build_block_index`; ``inputs_validated`` skips its check of the tensors and descales.

    For a caller that has just run :func:`~fpv2.kernel.contracts.validate_prefill_inputs` on the
    same ``q``, ``k_cache``, ``batch`` and descales with its V cache (a superset of the check here,
    which stands K in for V): the serving pipeline, to which the repeat cost ~20 us of host time per
    call. Config, strategy and statistics are checked either way.
    """
    if config is None:
        config = SelectionConfig()
    elif not isinstance(config, SelectionConfig):
        raise TypeError(f"config must be a SelectionConfig or None, got {type(config).__name__}")
    if isinstance(strategy, str):
        strategy = get_strategy(strategy)
    elif not isinstance(strategy, SelectionStrategy):
        raise TypeError(f"strategy must be a strategy name or a SelectionStrategy, got {type(strategy).__name__}")
    if not inputs_validated:
        # K stands in for V: this stage never reads values, and the FP8 rule wants a V descale too.
        validate_prefill_inputs(
            q, k_cache, k_cache, batch, q_descale=q_descale, k_descale=k_descale, v_descale=k_descale
        )
    if statistics is None:
        statistics = pool_blocks(k_cache, None, batch, block_size=config.block_size, k_descale=k_descale)
    elif statistics.num_kv_heads != k_cache.shape[2]:
        raise ValueError(
            f"statistics have Hkv={statistics.num_kv_heads} heads, k_cache has Hkv={k_cache.shape[2]} "
            f"(shape {tuple(k_cache.shape)})"
        )
    return strategy.select(q, batch, statistics, config=config, q_descale=q_descale, k_descale=k_descale)
