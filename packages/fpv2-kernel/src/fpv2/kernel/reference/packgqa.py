"""PackGQA: the row layout shared by index tiles and attention tiles.

For one KV head with ``g`` query heads, packed row ``r`` is query position
``r // g`` of query head ``kv_head * g + r % g``.
"""

from __future__ import annotations

import torch


def packed_rows_to_position_head(rows: torch.Tensor, group: int, kv_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, query heads)`` of packed ``rows`` of ``kv_head``."""
    return rows // group, kv_head * group + rows % group


def pack_queries(q: torch.Tensor, group: int, kv_head: int) -> torch.Tensor:
    """``(q_len * g, d)`` packed rows of one request's ``(q_len, Hq, d)`` queries for ``kv_head``."""
    q_len, _, d = q.shape
    return q[:, kv_head * group : (kv_head + 1) * group, :].reshape(q_len * group, d)


def unpack_rows(rows: torch.Tensor, group: int) -> torch.Tensor:
    """Inverse of :func:`pack_queries`: ``(q_len * g, d)`` -> ``(q_len, g, d)``."""
    return rows.reshape(rows.shape[0] // group, group, *rows.shape[1:])
