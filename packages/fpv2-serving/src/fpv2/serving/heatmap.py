"""PNG heatmap of the selected key blocks (query tiles x key blocks) of one KV head."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fpv2.kernel.contracts import BlockIndex, PagedPrefillBatch, num_query_tiles, tile_span

# Cell classes of the picture, in colormap order.
_HIDDEN, _PRUNED, _KEPT, _KEPT_PLANTED, _MISSED_PLANTED = range(5)
_COLORS = ("#e6e6e6", "#ffffff", "#4c72b0", "#2ca02c", "#d62728")
_LABELS = ("not visible (causal)", "pruned", "kept", "kept, planted", "pruned, planted")


@dataclass(frozen=True)
class SelectionPanel:
    """One panel of the heatmap: the index of one run and its caption."""

    title: str
    index: BlockIndex


def selection_grid(
    index: BlockIndex, batch: PagedPrefillBatch, request: int, kv_head: int, planted: torch.Tensor | None
) -> torch.Tensor:
    """``(tiles, blocks) uint8`` cell classes of one (request, KV head) of ``index``.

    Args:
        index: the block index.
        batch: the batch it was built for.
        request: request number.
        kv_head: KV head number.
        planted: ``(blocks,) bool`` planted key blocks of this head, or None.

    Returns:
        The class of every (tile, block) cell: hidden, pruned, kept, kept and
        planted, pruned and planted.

    Raises:
        IndexError: request or KV head out of range.
    """
    host = batch.host
    if not 0 <= request < batch.num_requests:
        raise IndexError(f"request {request} out of range for a batch of {batch.num_requests}")
    if not 0 <= kv_head < index.num_kv_heads:
        raise IndexError(f"kv_head {kv_head} out of range for {index.num_kv_heads} KV heads")
    q_len, prefix, kv_len = host.q_lens[request], host.prefix[request], host.seqlens_k[request]
    ntiles = num_query_tiles(q_len, index.group, index.tile_size)
    nblocks = -(-kv_len // index.block_size)
    first = index.num_kv_heads * int(index.tile_offsets[request]) + kv_head * ntiles
    offsets = index.offsets[first : first + ntiles + 1].cpu().long()
    blocks = index.blocks[int(offsets[0]) : int(offsets[-1])].cpu().long()
    rows = torch.repeat_interleave(torch.arange(ntiles), offsets[1:] - offsets[:-1])
    kept = torch.zeros(ntiles, nblocks, dtype=torch.bool)
    kept[rows, blocks] = True
    last_visible = torch.tensor(
        [
            tile_span(
                t, q_len, prefix, index.group, tile_size=index.tile_size, block_size=index.block_size
            ).last_visible_block
            for t in range(ntiles)
        ]
    )
    visible = torch.arange(nblocks)[None, :] <= last_visible[:, None]
    grid = torch.full((ntiles, nblocks), _HIDDEN, dtype=torch.uint8)
    grid[visible] = _PRUNED
    grid[kept] = _KEPT
    if planted is not None:
        mark = planted.cpu().bool()[None, :nblocks].expand(ntiles, nblocks)
        grid[kept & mark] = _KEPT_PLANTED
        grid[visible & ~kept & mark] = _MISSED_PLANTED
    return grid


def write_selection_heatmap(
    path: Path,
    panels: list[SelectionPanel],
    batch: PagedPrefillBatch,
    *,
    kv_head: int,
    planted: torch.Tensor | None,
    title: str,
    request: int = 0,
) -> Path:
    """Draw one panel per run (tiles down, key blocks across) and save a PNG with the Agg backend.

    Args:
        path: output file.
        panels: the runs to draw (at least one).
        batch: the batch the indices were built for.
        kv_head: KV head to draw.
        planted: ``(blocks,) bool`` planted key blocks of that head (marked above each panel).
        title: figure title.
        request: request to draw.

    Returns:
        ``path``.

    Raises:
        ValueError: no panels.
    """
    # The Figure/Agg canvas pair leaves pyplot's global backend state alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("write_selection_heatmap needs at least one panel")
    cmap = ListedColormap(list(_COLORS))
    norm = BoundaryNorm([x - 0.5 for x in range(len(_COLORS) + 1)], cmap.N)
    fig = Figure(figsize=(max(7.5, 4.2 * len(panels) + 0.5), 5.8), dpi=120)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        grid = selection_grid(panel.index, batch, request, kv_head, planted)
        ax.imshow(grid.numpy(), cmap=cmap, norm=norm, interpolation="nearest", aspect="auto")
        if planted is not None:
            cols = torch.nonzero(planted.cpu().bool()[: grid.shape[1]]).flatten().tolist()
            ax.plot(cols, [-0.5] * len(cols), "v", color=_COLORS[_KEPT_PLANTED], markersize=4, clip_on=False)
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel(f"key block ({panel.index.block_size} tokens)")
        ax.set_ylabel(f"query tile ({panel.index.tile_size} packed rows)")
    fig.legend(
        handles=[Patch(facecolor=c, edgecolor="#888888", label=label) for c, label in zip(_COLORS, _LABELS)],
        loc="lower center",
        ncol=3,
        fontsize=8,
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
