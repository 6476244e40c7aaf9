"""Soak the prefill pipeline: memory flat, index workspace bounded, host syncs per call counted.

Runs :func:`fpv2.serving.soak.run_soak`: ``--calls`` pipeline calls (10,000 by
default on a GPU) with seeded, varying batch composition (1..``--max-batch``
requests, KV lengths 1..``--max-len``, random cached prefixes, zero-length
requests, page sizes alternating between calls) through the pipeline on the
default backend. Per call it records CUDA allocated/reserved memory (RSS on the
CPU), the Triton index workspace and the host synchronisations inside the call
(PyTorch's sync debug mode; see :mod:`fpv2.serving.soak` for what that sees and
misses). Writes ``soak-<tag>.json`` (summary, sync sites, per-call columns) and
``soak-<tag>.png`` under ``--out``, prints the verdicts, and exits 1 when memory
grew past its bound, the workspace left its formula, syncs per call exceeded
``--max-syncs-per-call`` or a call raised.

Defaults are the GPU run (Hq=32, Hkv=8, d=128, bf16, B<=8, L<=16384, page sizes
1/16/64). ``--device cpu`` starts from :meth:`SoakConfig.for_cpu` (50 calls,
tiny shapes, the reference backend) and measures RSS.

Example::

    python benchmarks/soak.py --out benchmarks/results/soak
    python benchmarks/soak.py --device cpu --calls 100 --out soak-dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import sys
from pathlib import Path

import torch

from fpv2.serving.environment import environment_record, git_commit, gpu_name
from fpv2.serving.report import write_json
from fpv2.serving.soak import DTYPES, SoakConfig, SoakError, SoakResult, run_soak, write_soak_plot


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (None where the configuration's default applies).

    Args:
        argv: arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON and the plot")
    p.add_argument("--calls", type=int)
    p.add_argument("--max-batch", type=int)
    p.add_argument("--max-len", type=int)
    p.add_argument("--page-sizes", type=int, nargs="+")
    p.add_argument("--prefix-probability", type=float)
    p.add_argument("--empty-probability", type=float)
    p.add_argument("--q-heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--alpha", type=float)
    p.add_argument("--min-sparse-kv-len", type=int)
    p.add_argument("--strategy")
    p.add_argument("--no-correction", action="store_true")
    p.add_argument("--backend", help="attention backend (default: auto)")
    p.add_argument("--routed", action="store_true", help="soak RoutedPrefillPipeline instead")
    p.add_argument("--routing-table", help="routing table JSON for --routed")
    p.add_argument("--seed", type=int)
    p.add_argument("--steady-fraction", type=float)
    p.add_argument("--no-host-view", action="store_true", help="let the pipeline read batch.host from the device")
    p.add_argument("--no-syncs", action="store_true", help="do not count host syncs")
    p.add_argument("--check-every", type=int, help="finite-output check every N calls")
    p.add_argument("--max-syncs-per-call", type=int, help="fail above this many syncs per steady call (-1: no limit)")
    p.add_argument("--time-limit", type=float, help="stop drawing calls after this many seconds (as many calls as fit)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace, device: torch.device) -> SoakConfig:
    """The soak configuration: the device's defaults with the given options on top.

    Args:
        args: parsed options.
        device: where the soak runs (the CPU starts from :meth:`SoakConfig.for_cpu`).

    Returns:
        The configuration.
    """
    base = SoakConfig.for_cpu() if device.type == "cpu" else SoakConfig()
    changes: dict[str, object] = {}
    for name in (
        "calls",
        "max_batch",
        "max_len",
        "prefix_probability",
        "empty_probability",
        "q_heads",
        "kv_heads",
        "head_dim",
        "dtype",
        "alpha",
        "min_sparse_kv_len",
        "strategy",
        "backend",
        "routing_table",
        "seed",
        "steady_fraction",
        "check_every",
    ):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.page_sizes is not None:
        changes["page_sizes"] = tuple(args.page_sizes)
    if args.max_syncs_per_call is not None:
        changes["max_syncs_per_call"] = None if args.max_syncs_per_call < 0 else args.max_syncs_per_call
    if args.no_correction:
        changes["correction"] = False
    if args.routed:
        changes["routed"] = True
    if args.no_host_view:
        changes["seed_host_view"] = False
    if args.no_syncs:
        changes["count_syncs"] = False
    if args.time_limit is not None:
        changes["time_limit_s"] = args.time_limit
    return dataclasses.replace(base, **changes)


def verdict_lines(result: SoakResult) -> list[str]:
    """Short human-readable verdicts of a soak.

    Args:
        result: the run.

    Returns:
        The lines.
    """
    s = result.summary
    mib = 1 / 2**20
    head = f"soak: {s.get('calls')} calls on {result.device} ({result.backend})"
    lines = [f"{head}, steady from call {s.get('steady_from_call')}"]
    if result.stopped_early:
        lines.append(
            f"  stopped at the time limit ({result.config.time_limit_s:g} s): {s.get('calls')} of "
            f"{result.config.calls} planned calls"
        )
    for name, m in s.get("memory", {}).items():  # type: ignore[union-attr]
        if isinstance(m, dict):
            verdict = "flat" if m["flat"] else "GROWS"
            lines.append(
                f"  memory {name}: {m['first'] * mib:.1f} -> max {m['max'] * mib:.1f} MiB, growth "
                f"{m['growth_bytes'] * mib:.3f} MiB (bound {m['bound_bytes'] * mib:.1f}), slope "
                f"{m['slope_bytes_per_call']:.1f} B/call: {verdict}{' (informative)' if m.get('informative') else ''}"
            )
    w = s.get("workspace", {})
    if isinstance(w, dict):
        largest = w.get("max_bytes")
        shown = "n/a" if largest is None else f"{largest * mib:.3f} MiB"
        lines.append(
            f"  index workspace: max {shown}, bound {w['bound_bytes'] * mib:.3f} MiB (P, Nb, S = "
            f"{w['bound_shape_P_Nb_S']}), formula mismatches {w['formula_mismatches']}: "
            f"{'bounded' if w['within_bound'] and not w['formula_mismatches'] else 'OUT OF BOUND'}"
        )
    y = s.get("syncs", {})
    if isinstance(y, dict) and "per_call_max" in y:
        lines.append(
            f"  host syncs per steady call: median {y['per_call_median']}, max {y['per_call_max']} "
            f"(limit {y['limit_per_call']}, host view seeded: {y['host_view_seeded']})"
        )
        for site, n in y["sites_per_call"].items():
            lines.append(f"    {n:.2f}/call  {site}")
    elif isinstance(y, dict):
        lines.append(f"  host syncs: {y.get('method')}")
    if result.error:
        lines.append(f"  ERROR: {result.error}")
    lines.append(f"  verdict: {'ok' if s.get('ok') and not result.error else 'FAILED'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the soak.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``).

    Returns:
        0 when every check passed, 1 when one failed or a call raised, 2 for a missing GPU.
    """
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("error: --device cuda but no CUDA GPU here (use --device cpu for a dry run)", file=sys.stderr)
            return 2
        if device.index is None:  # torch 2.11 refuses set_device("cuda") without an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # many tiny ops: one thread is faster on small machines
    cfg = config_from_args(args, device)
    from tqdm import tqdm

    bar = tqdm(total=cfg.calls, desc="fpv2 soak", unit="call", disable=args.no_progress, mininterval=2.0)
    try:
        result = run_soak(cfg, device=device, progress=lambda i, r: bar.update())
    except SoakError as exc:
        result = exc.result
    finally:
        bar.close()
    tag = f"{cfg.dtype}-Hq{cfg.q_heads}-Hkv{cfg.kv_heads}-d{cfg.head_dim}-B{cfg.max_batch}-L{cfg.max_len}-n{cfg.calls}"
    payload = {
        **result.to_dict(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "gpu": gpu_name(device),
        "environment": environment_record(),
    }
    json_path = write_json(args.out / f"soak-{tag}.json", payload)
    plot_path = write_soak_plot(args.out / f"soak-{tag}.png", result)
    print("\n".join(verdict_lines(result)))
    print(f"wrote {json_path} and {plot_path}", file=sys.stderr)
    return 0 if result.summary.get("ok") and result.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
