"""What the CPU correction studies share: their workload arguments, inputs and the (workload, length, alpha) grid.

Used by ``grouped_correction_study.py`` and ``second_order_correction_study.py``; each adds its own
arguments, runs one ``study(workload, seqlen, alpha, args)`` per grid point and plots the records.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.testing import planted_workload

Record = dict[str, object]


def study_parser(description: str, *, seqlen: int, q_heads: int, kv_heads: int, out: str) -> argparse.ArgumentParser:
    """The grid's and the workload's arguments, with the study's defaults."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("planted", "drifting"), nargs="+", default=["planted", "drifting"])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[seqlen])
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    parser.add_argument("--q-heads", type=int, default=q_heads)
    parser.add_argument("--kv-heads", type=int, default=kv_heads)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.02, help="planted share of key blocks")
    parser.add_argument("--margin", type=float, default=7.0, help="planted logit margin")
    parser.add_argument("--drift-tokens", type=float, default=256.0, help="drifting background's correlation length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(f"fpv2-results/{out}"))
    return parser


def study_inputs(
    workload: str, seqlen: int, args: argparse.Namespace
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedPrefillBatch]:
    """``(q, k_cache, v_cache, batch)`` of one request in fp32, rounded through bf16 as the benchmark's inputs."""
    wl = planted_workload(
        [seqlen],
        num_q_heads=args.q_heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        page_size=128,
        fraction=args.fraction,
        margin=args.margin,
        seed=args.seed,
        drift_tokens=args.drift_tokens if workload == "drifting" else None,
    )
    return wl.q.float(), wl.k_cache.float(), wl.v_cache.float(), wl.batch


def record_header(workload: str, seqlen: int, alpha: float, args: argparse.Namespace, density: float) -> Record:
    """The fields every study record starts with."""
    return {
        "workload": workload,
        "L": seqlen,
        "alpha": alpha,
        "Hq": args.q_heads,
        "Hkv": args.kv_heads,
        "d": args.head_dim,
        "density": density,
    }


def workload_panels(records: list[Record], panel_width: float) -> tuple[object, list[tuple[object, str, list[Record]]]]:
    """A figure with one panel per workload (in record order): ``(figure, [(axes, workload, its records)])``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in records))
    fig, axes = plt.subplots(1, len(workloads), figsize=(panel_width * len(workloads), 4.5), squeeze=False)
    panels = [(ax, w, [r for r in records if r["workload"] == w]) for ax, w in zip(axes[0], workloads)]
    return fig, panels


def grouped_bars(ax: object, series: dict[str, list[float]], labels: list[str], title: str) -> None:
    """One group of bars per x label (a bar per series, side by side), the labels under them, a legend."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(values))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_title(title)
    ax.legend(fontsize=7)


def save_figure(fig: object, path: Path) -> None:
    """Write ``fig`` as a PNG and release it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_grid(
    study: Callable[[str, int, float, argparse.Namespace], Record],
    args: argparse.Namespace,
    name: str,
    plot: Callable[[list[Record], Path], None],
) -> list[Record]:
    """Run ``study`` at every (workload, length, alpha); write ``NAME.json`` and ``NAME.png`` under ``args.out``."""
    torch.manual_seed(args.seed)
    records = [
        study(workload, seqlen, alpha, args)
        for workload in args.workload
        for seqlen in args.seqlen
        for alpha in args.alpha
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(records, indent=2))
    plot(records, args.out / f"{name}.png")
    return records
