"""Vertical-slash selection: the MInference pattern, estimated at block granularity from the last queries.

Follows the "vertical-slash" head pattern of MInference 1.0 (Jiang et al.,
"MInference 1.0: Accelerating Pre-filling for Long-Context LLMs via Dynamic
Sparse Attention", 2024): attention of a head concentrates on a few *vertical*
columns (keys every query attends to) and a few *slash* diagonals (keys at a
fixed distance behind the query). MInference estimates both from the attention
of the last queries to all keys and then keeps the top columns and diagonals
for every query. Here, per (request, KV head):

1. Estimate: the packed rows of the request's last ``last_queries`` positions
   (all ``g`` query heads) score the pooled keys, ``s_rJ = q_r . kbar_J * scale``.
   Each block's logit is weighted by the number of its tokens the row can see
   (``log n_rJ`` added), so ``softmax_J`` over a row estimates the share of that
   row's attention mass falling into block ``J``. These per-row shares are
   summed per query block ``Q``: ``A[Q, J]``.
2. Vertical score of block ``J``: ``sum_Q A[Q, J]``. The ``vertical_blocks`` best
   blocks outside the sink are the verticals.
3. Slash score of offset ``o = Q - J``: the sum of ``A[Q, J]`` along that block
   diagonal, after removing the columns of the verticals and of the sink (our
   refinement: a strong column would otherwise also show up as a slash at every
   offset it sits at). The ``slash_blocks`` best offsets beyond the ones the
   diagonal band and window always cover (``o > window_tokens // Bk``) are the
   slashes.
4. Per sparse tile covering query blocks ``a .. z``: the forced blocks, every
   visible vertical, and every block ``J = Q - o`` for a slash ``o`` and
   ``a <= Q <= z``.

Budgets count blocks beyond what the config forces, as in MInference they are
fixed per head, so the density falls as the context grows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from fpv2.kernel.contracts import cdiv

from ..config import SelectionConfig
from ..reference.scoring import block_logits
from ..reference.selection import MAX_LOGITS_PER_STEP
from .registry import register_strategy
from .streaming import ForcedPlusExtraSelection, HeadSelectionInputs
from .top_k import top_k_mask


def _check_budget(name: str, value: object, minimum: int) -> None:
    """Refuse non-ints (bools included) and values below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"VerticalSlashStrategy.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"VerticalSlashStrategy.{name} must be >= {minimum}, got {value}")


def query_block_attention(inputs: HeadSelectionInputs, last_queries: int, block_size: int) -> tuple[torch.Tensor, int]:
    """Estimated attention shares of the last queries, summed per query block (step 1 of the module docstring).

    Args:
        inputs: the (request, KV head).
        last_queries: query positions at the end of the request used for the estimate.
        block_size: tokens per key block ``Bk``.

    Returns:
        ``(A, first)``: ``A`` is ``(nQ, nb) float32``, row ``i`` holding the summed
        per-row attention shares of the rows whose position lies in query block
        ``first + i`` (each row's shares sum to 1); ``first`` is the first such block.
    """
    pooled = inputs.pooled_k
    nb = pooled.shape[0]
    start = max(0, inputs.q_len - last_queries) * inputs.group
    end = inputs.q_len * inputs.group
    rows = inputs.rows.flatten(0, 1)[start:end]
    positions = inputs.tiles.row_positions.flatten()[start:end]
    first = (inputs.prefix + start // inputs.group) // block_size
    last = (inputs.prefix + inputs.q_len - 1) // block_size
    shares = torch.zeros(last - first + 1, nb, dtype=torch.float32, device=pooled.device)
    if nb == 0:
        return shares, first
    block_start = torch.arange(nb, device=pooled.device) * block_size
    step = max(1, MAX_LOGITS_PER_STEP // nb)
    for begin in range(0, rows.shape[0], step):
        pos = positions[begin : begin + step]
        logits = block_logits(rows[None, begin : begin + step], pooled, inputs.scale)[0]  # log2 units
        # Tokens of block J the row sees (the tail block is shorter, but no row lies past it).
        seen = torch.clamp(pos[:, None] - block_start[None, :] + 1, max=block_size)
        weighted = torch.where(seen > 0, logits + torch.log2(seen.clamp(min=1).float()), -math.inf)
        # Every row sees block 0, so its maximum is finite.
        probs = torch.exp2(weighted - weighted.amax(dim=1, keepdim=True))
        probs = probs / probs.sum(dim=1, keepdim=True)
        shares.index_add_(0, pos // block_size - first, probs)
    return shares, first


def slash_scores(shares: torch.Tensor, first: int) -> torch.Tensor:
    """``(nb,)`` mass of ``shares`` along each block diagonal ``o = Q - J`` (``o = 0`` is the diagonal block).

    Args:
        shares: ``(nQ, nb)`` attention shares of query blocks ``first .. first + nQ - 1``.
        first: the first query block.

    Returns:
        The summed mass per offset ``o`` in ``0 .. nb - 1``.
    """
    nb = shares.shape[1]
    query_blocks = torch.arange(first, first + shares.shape[0], device=shares.device)
    offsets = query_blocks[:, None] - torch.arange(nb, device=shares.device)[None, :]
    behind = offsets >= 0
    return torch.zeros(nb, dtype=shares.dtype, device=shares.device).index_add_(0, offsets[behind], shares[behind])


def slash_block_mask(slashes: torch.Tensor, first_block: torch.Tensor, last_block: torch.Tensor) -> torch.Tensor:
    """``(T, nb) bool``: block ``J`` lies on a chosen slash for some query block of the tile.

    Block ``J`` is on slash ``o`` for query block ``Q`` when ``J = Q - o``; a tile
    covering query blocks ``a .. z`` takes ``J`` when some chosen ``o`` lies in
    ``max(a - J, 0) .. z - J``. Counted with a prefix sum over offsets, so the
    cost is ``O(T nb)`` whatever the number of slashes.

    Args:
        slashes: ``(nb,) bool`` chosen offsets.
        first_block: ``(T,)`` first query block of each tile (its first diagonal block).
        last_block: ``(T,)`` last query block of each tile (its last visible block).

    Returns:
        The blocks on the tile's slashes (all at or below ``last_block``).
    """
    nb = slashes.shape[0]
    before = torch.zeros(nb + 1, dtype=torch.int64, device=slashes.device)
    before[1:] = slashes.long().cumsum(0)
    ids = torch.arange(nb, device=slashes.device)[None, :]
    lo = torch.clamp(first_block[:, None] - ids, min=0)
    hi = last_block[:, None] - ids
    count = before[torch.clamp(hi + 1, min=0, max=nb)] - before[torch.clamp(lo, max=nb)]
    return (hi >= 0) & (count > 0)


@register_strategy("vertical_slash")
@dataclass(frozen=True)
class VerticalSlashStrategy(ForcedPlusExtraSelection):
    """MInference's vertical-slash pattern, estimated per (request, KV head) from the last queries.

    See the module docstring for the method. Every sparse tile keeps its forced
    blocks (sink, window, diagonal band), the verticals it can see and the
    blocks on the slashes through its query blocks; dense-fallback tiles keep
    every visible block. ``config.alpha`` and ``config.probe_stride`` are ignored.

    Args:
        vertical_blocks: vertical key blocks kept per (request, KV head), chosen
            outside the sink blocks; each adds at most one block per tile.
            Default ``32`` (4096 tokens at ``Bk = 128``).
        slash_blocks: slash offsets kept per (request, KV head), chosen beyond
            the offsets the diagonal band and window cover
            (``o > window_tokens // Bk``); each adds at most one block per
            query block the tile spans (usually 1 or 2 per tile).
            Default ``8``.
        last_queries: query positions at the end of each request whose rows (all
            ``g`` heads) estimate the pattern; spanning several key blocks lets the
            slashes be told apart from the verticals. Default ``512``.

    Raises:
        TypeError: a budget is not an int.
        ValueError: a budget is negative, both budgets are 0, or ``last_queries < 1``.

    Attributes:
        name: ``"vertical_slash"``.
    """

    vertical_blocks: int = 32
    slash_blocks: int = 8
    last_queries: int = 512
    name: ClassVar[str] = "vertical_slash"

    def __post_init__(self) -> None:
        _check_budget("vertical_blocks", self.vertical_blocks, 0)
        _check_budget("slash_blocks", self.slash_blocks, 0)
        _check_budget("last_queries", self.last_queries, 1)
        if self.vertical_blocks == 0 and self.slash_blocks == 0:
            raise ValueError(
                "VerticalSlashStrategy needs vertical_blocks > 0 or slash_blocks > 0, got 0 and 0; "
                "the 'streaming' strategy keeps forced blocks only"
            )

    def pattern(self, inputs: HeadSelectionInputs, config: SelectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The verticals and slashes of one (request, KV head) (steps 1-3 of the module docstring).

        Args:
            inputs: the (request, KV head).
            config: selection parameters (``block_size``, ``sink_tokens``, ``window_tokens``).

        Returns:
            ``(verticals, slashes)``, two ``(nb,) bool`` masks: chosen key blocks and chosen offsets.
        """
        bk = config.block_size
        shares, first = query_block_attention(inputs, self.last_queries, bk)
        nb = shares.shape[1]
        ids = torch.arange(nb, device=shares.device)
        sink = ids < cdiv(config.sink_tokens, bk)
        vertical_score = shares.sum(dim=0)
        verticals = top_k_mask(vertical_score[None], ~sink[None] & (vertical_score[None] > 0), self.vertical_blocks)[0]
        residual = shares.masked_fill((verticals | sink)[None, :], 0.0)
        slash_score = slash_scores(residual, first)
        rankable = (ids > config.window_tokens // bk) & (slash_score > 0)
        slashes = top_k_mask(slash_score[None], rankable[None], self.slash_blocks)[0]
        return verticals, slashes

    def extra_blocks(self, inputs: HeadSelectionInputs, config: SelectionConfig) -> torch.Tensor:
        """Vertical and slash blocks of every sparse tile of one (request, KV head) (step 4).

        Args:
            inputs: the (request, KV head).
            config: selection parameters.

        Returns:
            ``(T, nb) bool`` chosen blocks (forced blocks not necessarily included).
        """
        verticals, slashes = self.pattern(inputs, config)
        tiles = inputs.tiles
        on_slash = slash_block_mask(slashes, tiles.first_diagonal_block, tiles.last_visible_block)
        return (verticals[None, :] | on_slash) & inputs.sparse[:, None]
