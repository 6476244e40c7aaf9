"""Reference corrected sparse attention: exact attention over kept blocks plus the mean correction.

For each packed row ``r`` of a tile: exact causal softmax attention over the
tokens of the kept blocks, and for every todo block ``J`` of the plan one extra
softmax term with logit ``q_r . kbar_J * scale + log |B_J|`` and value
``vbar_J`` (ALGORITHM.md section 6). The arithmetic lives in
:func:`fpv2.kernel.reference.sparse.sparse_attention`; this module only names
the corrected call.
"""

from __future__ import annotations

from typing import Any

import torch

from fpv2.kernel.contracts import BlockIndex, CorrectionPlan, PagedPrefillBatch


def corrected_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PagedPrefillBatch,
    index: BlockIndex,
    plan: CorrectionPlan,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention with the mean correction for pruned blocks (PyTorch reference).

    Args:
        q: ``(total_q, Hq, d)`` packed queries.
        k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
        v_cache: ``(num_pages, page_size, Hkv, d)`` paged values.
        batch: the paged prefill batch.
        index: kept blocks per (request, KV head, tile).
        plan: the correction plan (see :func:`fpv2.correction.build_correction_plan`);
            required, since dropping pruned blocks silently is what this call avoids.
        **kwargs: forwarded to ``sparse_attention``: ``softmax_scale``,
            ``compute_dtype``, ``q_descale``, ``k_descale``, ``v_descale``, ``return_lse``.

    Returns:
        ``(total_q, Hq, d)`` output, or ``(output, lse)`` with ``return_lse=True``.

    Raises:
        TypeError: ``plan`` is not a :class:`~fpv2.kernel.CorrectionPlan`.
        ImportError: the kernel wheel has no ``fpv2.kernel.reference.sparse``.
    """
    if not isinstance(plan, CorrectionPlan):
        raise TypeError(f"plan must be a CorrectionPlan, got {type(plan).__name__}")
    # Imported here so the correction wheel imports even against a kernel wheel without the sparse reference.
    from fpv2.kernel.reference.sparse import sparse_attention

    return sparse_attention(q, k_cache, v_cache, batch, index, plan=plan, **kwargs)
