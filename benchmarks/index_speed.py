"""Index-stage speed: pooling, fused scoring/selection and CSR compaction; full-row vs probe-row scoring.

On the planted workload (BENCHMARKS.md), for each ``--seqlens`` L (B=1), this
times (median of ``--repeats`` CUDA-event runs after ``--warmup``):

- ``pool``: :func:`fpv2.index.triton.pool_blocks_triton` of K and V (what the
  pipeline pools once for the index and the correction);
- ``select``: :func:`fpv2.index.triton.select_blocks_triton` (fused scoring +
  selection with the counts' prefix sum, compaction; the scoring copy of the keys
  comes from the pooling) on those statistics;
- ``index``: both back to back, the issue's "index time"; also as a CUDA graph
  replay (GPU time without host launch overhead) and the host time to enqueue
  one call;
- a per-kernel breakdown of one index call (``torch.profiler``, GPU time);
- with ``--baseline-dir``: the same for an older copy of the
  ``fpv2/index/triton`` package (loaded under another module name), and how
  many (segment, block) pairs its index differs from the current one's;
- ``--probes``: selection scoring every s-th packed row (``probe_stride``):
  index time and density, and for the L in ``--error-seqlens`` the relative L2
  error of the whole sparse pipeline's output (:class:`fpv2.serving.pipeline.SparsePrefillPipeline`,
  correction on) against fp32 dense attention, with the pipeline's stage times;
- ``--sweep``: launch knobs of the scoring and pooling kernels (:mod:`fpv2.index.triton.tuning`);
- ``--tiles-per-program 1 2`` (with ``--mma-store 0 1``, ``--pair-stages 2 3``): every row above for each
  scoring variant, in the same process: one or two query tiles per program, the energies stored from the
  MMA layout or not, the pipeline depth of the two-tile kernel. The first variant is the identity
  reference: every other variant's index is compared with it pair by pair (``pairs_differing_from_first``)
  and exactly (``identical_to_first``: same offsets and blocks), probe by probe; ``score_kernel`` records
  the compiled scoring kernel's registers, spills, shared memory and resident programs per SM.
  Rows of a variant other than the default knobs are labelled ``current/<variant>`` (e.g. ``current/tpp2``).

It also writes the floor of the index stage for each L (bytes, GEMM FLOPs,
exponentials; see ``floor`` in the JSON). Writes ``index-speed.json`` (and
``h200-summary.json``-style records in ``summary.json``) under ``--out`` and
prints a table. ``--device cpu`` with ``TRITON_INTERPRET=1`` and a small
``--seqlens`` is a dry run of the plumbing (its times mean nothing).

Example::

    python benchmarks/index_speed.py --out benchmarks/results/index-speed --sweep
    python benchmarks/index_speed.py --out <dir> --probes --error-seqlens --tiles-per-program 1 2 --mma-store 0 1
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import torch

from fpv2.index import SelectionConfig
from fpv2.index import triton as index_triton
from fpv2.index.triton import scoring, tuning
from fpv2.kernel.contracts import BlockIndex, PagedPrefillBatch, num_query_tiles, tile_span
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.testing import planted_workload
from fpv2.serving.environment import environment_record, git_commit, gpu_name
from fpv2.serving.metrics import index_flops, relative_l2_error, tflops
from fpv2.serving.pipeline import SparsePrefillPipeline
from fpv2.serving.report import write_json
from fpv2.serving.timing import benchmark_device, median, protocol_notes, timed_samples

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Fewest timed runs the protocol accepts on a GPU.
#: Machine constants of the floor (H200): HBM3e peak bandwidth, measured bf16 dense GEMM rate (tool library),
#: and MUFU exp2 throughput (16 per clock per SM at an assumed 1.98 GHz boost clock).
HBM_BYTES_PER_S = 4.8e12
GEMM_FLOPS_PER_S = 790e12
MUFU_PER_CLOCK_PER_SM = 16
CLOCK_HZ = 1.98e9
#: Scoring knobs swept by ``--sweep``: (block_n, num_warps, num_stages, programs_per_sm, maxnreg). About 230 registers
#: per thread fit two 4-warp programs per SM; capped at 168 (spilling outside the scoring loop only), three.
SCORE_SWEEP = [(64, 4, 2, 2, None), (64, 4, 2, 3, 168), (64, 4, 3, 2, None)]
#: Pooling knobs swept by ``--sweep``: (tokens, num_warps, heads per program); ``tokens`` at every page size.
POOL_SWEEP = [
    (16, 2, 1), (16, 1, 1), (32, 2, 1), (8, 4, 8), (16, 8, 8), (16, 4, 2),
    (8, 4, 2), (8, 4, 4), (16, 4, 4), (32, 4, 2), (32, 8, 4), (8, 2, 2),
    (128, 8, 1), (128, 4, 1), (64, 4, 1), (64, 8, 2), (32, 4, 1),
    (16, 4, 8), (32, 8, 8), (8, 8, 8), (4, 4, 8), (4, 2, 4), (8, 2, 1), (16, 2, 2),
]  # fmt: skip
#: Machine-specific path prefixes removed from everything written to the results.
_PATH_PREFIXES = ("/work/", "/root/", "/tmp/", "/home/")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options.

    Args:
        argv: arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seqlens", type=int, nargs="+", default=[32768, 131072], help="L values (default 32768 131072)")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--alpha", type=float, default=SelectionConfig.alpha)
    p.add_argument("--probes", type=int, nargs="*", default=[2, 4, 8], help="probe strides beside full-row scoring")
    p.add_argument(
        "--error-seqlens", type=int, nargs="*", default=[32768], help="L values with the pipeline error column"
    )
    p.add_argument("--backend", default="auto", help="attention backend of the error pipeline")
    p.add_argument("--pipeline-repeats", type=int, default=5, help="timed runs of the error pipeline")
    p.add_argument("--baseline-dir", type=Path, default=None, help="an older fpv2/index/triton package folder")
    p.add_argument("--baseline-label", default="baseline", help="impl name of the baseline rows")
    p.add_argument("--sweep", action="store_true", help="also sweep the kernels' launch knobs")
    p.add_argument("--sweep-seqlens", type=int, nargs="*", default=[131072], help="L values of the sweep")
    p.add_argument(
        "--sweep-kernels",
        nargs="+",
        choices=("score", "pool"),
        default=["score", "pool"],
        help="kernels whose knobs the sweep varies (default both)",
    )
    p.add_argument(
        "--auto-tune",
        action="store_true",
        help="run the sweep before the main rows and keep the fastest knobs for every later row (put a sweep L first)",
    )
    p.add_argument(
        "--tiles-per-program",
        type=int,
        nargs="+",
        choices=(1, 2),
        default=None,
        help="scoring variants: query tiles per program (default: the knob's value)",
    )
    p.add_argument(
        "--mma-store",
        type=int,
        nargs="+",
        choices=(0, 1),
        default=None,
        help="scoring variants: store energies from the MMA layout, 0/1 (default: the knob's value)",
    )
    p.add_argument(
        "--pair-stages",
        type=int,
        nargs="+",
        default=None,
        help="scoring variants: pipeline depth with two tiles per program (default: the knob's value)",
    )
    p.add_argument("--no-host-profile", action="store_true", help="skip the cProfile of the host side")
    p.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile")
    p.add_argument("--fraction", type=float, default=0.02, help="planted fraction of key blocks")
    p.add_argument("--margin", type=float, default=7.0, help="planted logit margin")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    args = p.parse_args(argv)
    for name in ("q_heads", "kv_heads", "head_dim", "page_size", "repeats", "pipeline_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or any(s < 1 for s in args.seqlens) or any(s < 2 for s in args.probes):
        p.error("--warmup must be >= 0, --seqlens >= 1 and --probes >= 2")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.pair_stages is not None and min(args.pair_stages) < 1:
        p.error("--pair-stages must be >= 1")
    return args


def sanitize(value: object) -> object:
    """``value`` with machine paths cut down to their last component (results are committed)."""
    if isinstance(value, str):
        for prefix in _PATH_PREFIXES:
            while prefix in value:
                head, _, tail = value.partition(prefix)
                rest = tail.split()[0] if tail.split() else tail
                value = head + "<path>/" + rest.rsplit("/", 1)[-1] + tail[len(rest) :]
        return value
    if isinstance(value, dict):
        return {k: sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v) for v in value]
    return value


def load_baseline(folder: Path) -> ModuleType:
    """Import an older copy of the ``fpv2/index/triton`` package as ``fpv2.index._baseline_triton``.

    Its relative imports of ``..config`` resolve to the current ``fpv2.index``
    (the selection config is unchanged); its kernels are its own.
    """
    name = "fpv2.index._baseline_triton"
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"no package under {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], args: argparse.Namespace, device: torch.device) -> tuple[float, list[float]]:
    """``(median ms, samples)`` of ``fn`` (:func:`fpv2.serving.timing.timed_samples`)."""
    samples, _ = timed_samples(fn, args.warmup, args.repeats, device)
    return median(samples), samples


def host_enqueue_ms(fn: Callable[[], object], device: torch.device, calls: int = 10) -> float:
    """Median host time to issue one call with the device idle (launch and Python overhead)."""
    values = []
    for _ in range(calls):
        sync(device)
        t0 = time.perf_counter()
        result = fn()
        values.append((time.perf_counter() - t0) * 1e3)
        del result
    sync(device)
    return median(values)


def graph_ms(fn: Callable[[], object], args: argparse.Namespace, device: torch.device) -> float | None:
    """Median GPU time of ``fn`` replayed as a CUDA graph (no host overhead); None off CUDA or if capture fails."""
    if device.type != "cuda":
        return None
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            keep = fn()
        ms, _ = timed(graph.replay, args, device)
        del keep, graph
        return ms
    except Exception as exc:  # a diagnostic: report, do not fail the run
        print(f"note: CUDA graph capture failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None


def kernel_profile(fn: Callable[[], object], device: torch.device, calls: int = 5) -> list[dict[str, object]]:
    """GPU time per kernel of one call (mean of ``calls``), from ``torch.profiler``; empty if unavailable."""
    if device.type != "cuda":
        return []
    try:
        from torch.profiler import ProfilerActivity, profile

        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            sync(device)
        totals: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            name = event.name if len(event.name) <= 72 else event.name[:69] + "..."
            entry = totals.setdefault(name, [0.0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us()
        rows = [{"kernel": k, "calls": c / calls, "us": us / calls} for k, (c, us) in totals.items()]
        return sorted(rows, key=lambda r: -float(r["us"]))
    except Exception as exc:
        print(f"note: profiler unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return []


def index_floor(batch: PagedPrefillBatch, args: argparse.Namespace, config: SelectionConfig, sms: int) -> dict:
    """Bytes, FLOPs and exponentials the index stage cannot avoid, and the times they take at peak rates."""
    group = args.q_heads // args.kv_heads
    rows = -(-config.tile_size // config.probe_stride)
    scored = 0  # (tile, pooled key) pairs scored per KV head
    for q_len, prefix, kv_len in zip(batch.host.q_lens, batch.host.prefix, batch.host.seqlens_k):
        n = num_query_tiles(q_len, group, config.tile_size)
        dense_request = kv_len < config.min_sparse_kv_len
        for t in range(n):
            if dense_request or t >= n - config.dense_tail_tiles:
                continue
            span = tile_span(t, q_len, prefix, group, tile_size=config.tile_size, block_size=config.block_size)
            scored += span.num_scored_blocks
    total_q = batch.host.cu_seqlens_q[-1]
    total_k = sum(batch.host.seqlens_k)
    exps = scored * rows * args.kv_heads
    gemm = 2.0 * exps * args.head_dim
    q_bytes = total_q * args.q_heads * args.head_dim * 2 / config.probe_stride
    kv_bytes = 2 * total_k * args.kv_heads * args.head_dim * 2
    mufu_rate = MUFU_PER_CLOCK_PER_SM * sms * CLOCK_HZ
    key_bytes = scored * args.kv_heads * args.head_dim * 2  # pooled keys re-read (from L2) by every tile
    return {
        "key_l2_bytes": key_bytes,
        "q_bytes": q_bytes,
        "kv_pool_bytes": kv_bytes,
        "scored_pairs_per_kv_head": scored,
        "exp2_count": exps,
        "gemm_flops": gemm,
        "q_read_ms": q_bytes / HBM_BYTES_PER_S * 1e3,
        "kv_pool_read_ms": kv_bytes / HBM_BYTES_PER_S * 1e3,
        "gemm_ms": gemm / GEMM_FLOPS_PER_S * 1e3,
        "exp2_ms": exps / mufu_rate * 1e3,
        "assumptions": (
            f"HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s, bf16 GEMM {GEMM_FLOPS_PER_S / 1e12:.0f} TFLOP/s, "
            f"{MUFU_PER_CLOCK_PER_SM} exp2/clock/SM x {sms} SMs x {CLOCK_HZ / 1e9:.2f} GHz"
        ),
    }


def sweep(
    w: object,
    config: SelectionConfig,
    base: dict[str, object],
    args: argparse.Namespace,
    device: torch.device,
    sweep_rows: list[dict[str, object]],
    log: Callable[[str], None],
) -> None:
    """Time selection under each scoring knob set and pooling under each pooling knob set (full-row scoring)."""
    for block_n, warps, stages, per_sm, maxnreg in SCORE_SWEEP if "score" in args.sweep_kernels else []:
        knobs = replace(tuning.SCORE, block_n=block_n, num_warps=warps, num_stages=stages)
        knobs = replace(knobs, programs_per_sm=per_sm, maxnreg=maxnreg)
        previous = tuning.set_tuning(score=knobs)
        try:
            row, _ = measure_index(index_triton, "current", w, config, args, device, extras=False)
            sweep_rows.append({**base, "kernel": "score", "knobs": vars(knobs), "select_ms": row["select_ms"]})
        except Exception as exc:
            sweep_rows.append({**base, "kernel": "score", "knobs": vars(knobs), "error": str(exc)})
        finally:
            tuning.set_tuning(score=previous[0])
        log(f"sweep {sweep_rows[-1]}")
    for tokens, warps, heads in POOL_SWEEP if "pool" in args.sweep_kernels else []:
        knobs = tuning.PoolTuning(tokens, warps, heads, gather_tokens=tokens)  # the same step at every page size
        previous = tuning.set_tuning(pool=knobs)
        try:
            pool_ms, _ = timed(pool_call(w), args, device)
            gpu_ms = graph_ms(pool_call(w), args, device)  # the call is host-bound at 32K: GPU time apart
            sweep_rows.append({**base, "kernel": "pool", "knobs": vars(knobs), "pool_ms": pool_ms, "graph_ms": gpu_ms})
        except Exception as exc:
            sweep_rows.append({**base, "kernel": "pool", "knobs": vars(knobs), "error": str(exc)})
        finally:
            tuning.set_tuning(pool=previous[1])
        log(f"sweep {sweep_rows[-1]}")


def best_knobs(sweep_rows: list[dict[str, object]], seqlen: int) -> dict[str, object]:
    """The fastest scoring and pooling knobs of the sweep at ``seqlen`` (as ``set_tuning`` keyword arguments)."""
    best: dict[str, object] = {}
    for kernel, metric, cls in (("score", "select_ms", tuning.ScoreTuning), ("pool", "pool_ms", tuning.PoolTuning)):
        timed_rows = [r for r in sweep_rows if r["L"] == seqlen and r["kernel"] == kernel and metric in r]
        if timed_rows:
            knobs = dict(min(timed_rows, key=lambda r: r[metric])["knobs"])
            if "probe_programs_per_sm" in knobs:
                knobs["probe_programs_per_sm"] = tuple(knobs["probe_programs_per_sm"])
            best[kernel] = cls(**knobs)
    return best


def host_profile(w: object, config: SelectionConfig, device: torch.device, calls: int = 50) -> list[dict]:
    """Where the host time of one index call goes: cProfile of ``calls`` calls (GPU idle between calls), top 20."""
    import cProfile
    import pstats

    workspace = index_triton.IndexWorkspace(device)

    def index() -> object:
        stats = index_triton.pool_blocks_triton(w.k_cache, w.v_cache, w.batch, block_size=config.block_size)
        return index_triton.select_blocks_triton(w.q, w.batch, stats, config=config, workspace=workspace)

    index()
    sync(device)
    profiler = cProfile.Profile()
    for _ in range(calls):
        profiler.enable()
        result = index()
        profiler.disable()
        del result
        sync(device)
    table = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    out = [
        {
            "function": f"{Path(key[0]).name}:{key[1]}({key[2]})",
            "calls_per_index": nc / calls,
            "self_us": tottime / calls * 1e6,
            "cumulative_us": cumtime / calls * 1e6,
        }
        for key, (cc, nc, tottime, cumtime, _) in table.items()
    ]
    return sorted(out, key=lambda r: -r["self_us"])[:20]


def launch_overheads(device: torch.device, calls: int = 200) -> dict[str, float]:
    """Median host microseconds to issue one small Triton kernel, one torch op and one allocation (GPU idle).

    The Triton launch goes through :class:`fpv2.index.triton.launcher.Relauncher` (direct relaunch after the
    first call), like every index kernel; ``FPV2_TRITON_RELAUNCH=0`` measures ``JITFunction.run`` instead.
    """
    from fpv2.index.triton.scoring import DOT_BF16, launch_prepare_keys

    x = torch.randn(64, 8, 128, device=device)
    counts = torch.ones(4096, dtype=torch.int32, device=device)

    def per_call(fn: Callable[[], object]) -> float:
        fn()
        sync(device)
        values = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            values.append((time.perf_counter() - t0) * 1e6)
        sync(device)
        return median(values)

    return {
        "triton_launch_us": per_call(lambda: launch_prepare_keys(x, 0.1, DOT_BF16)),
        "torch_cumsum_us": per_call(lambda: torch.cumsum(counts, 0, dtype=torch.int32)),
        "torch_empty_us": per_call(lambda: torch.empty(4096, dtype=torch.int32, device=device)),
    }


def score_variants(args: argparse.Namespace, base: tuning.ScoreTuning) -> list[tuple[str, tuning.ScoreTuning]]:
    """The scoring variants to time, ``(label, knobs)``, first the identity reference; ``""`` labels ``base``.

    The product of ``--tiles-per-program``, ``--mma-store`` and (for two tiles) ``--pair-stages``, each
    defaulting to the value in ``base``; duplicates dropped, order kept.
    """
    tiles = args.tiles_per_program or [base.tiles_per_program]
    stores = [bool(m) for m in args.mma_store] if args.mma_store else [base.mma_store]
    stages = args.pair_stages or [base.pair_num_stages]
    variants: list[tuple[str, tuning.ScoreTuning]] = []
    for t in tiles:
        for m in stores:
            for st in stages if t == 2 else [base.pair_num_stages]:
                knobs = replace(base, tiles_per_program=t, mma_store=m, pair_num_stages=st)
                if any(k == knobs for _, k in variants):
                    continue
                parts = [f"tpp{t}"] if t != base.tiles_per_program else []
                if m != base.mma_store:
                    parts.append("mma" if m else "convert")
                if t == 2 and st != base.pair_num_stages:
                    parts.append(f"s{st}")
                variants.append(("-".join(parts), knobs))
    return variants


def identical(a: BlockIndex, b: BlockIndex) -> bool:
    """Whether two indexes have the same offsets and the same first ``nnz`` block ids (the strict check)."""
    if a.offsets.shape != b.offsets.shape or not torch.equal(a.offsets, b.offsets):
        return False
    nnz = int(a.offsets[-1])
    return bool(torch.equal(a.blocks[:nnz], b.blocks[:nnz]))


def _occupancy(function: int, threads: int, shared: int) -> int | None:
    """Resident blocks per SM of a loaded kernel (``cuOccupancyMaxActiveBlocksPerMultiprocessor``), None if unknown."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        blocks = ctypes.c_int(0)
        status = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), ctypes.c_void_p(function), ctypes.c_int(threads), ctypes.c_size_t(shared)
        )
        return blocks.value if status == 0 else None
    except (OSError, AttributeError, TypeError):
        return None


def score_kernel_report(
    knobs: tuning.ScoreTuning, head_dim: int, max_blocks: int, device: torch.device
) -> dict[str, object]:
    """Registers, spills, shared memory and resident programs per SM of the full-row scoring kernel of ``knobs``.

    Read from Triton's in-process cache of compiled kernels (the one whose constants match the variant, the
    full 128-row tile and this L's pass-2 width); a diagnostic: an empty dict when none is found.
    """
    if device.type != "cuda":
        return {}
    try:
        fn = scoring._score_select_kernel
        cache = fn.device_caches[torch.cuda.current_device()][0]
        want = {
            "TILES": knobs.tiles_per_program,
            "MMA_STORE": knobs.mma_store,
            "ROWS": 128,
            "PROBE": 1,
            "PASS2": scoring.pass2_blocks(max_blocks),
        }
        stages = knobs.stages_for(head_dim)
        for kernel in reversed(list(cache.values())):
            consts = {fn.arg_names[k[0]]: v for k, v in kernel.src.constants.items() if len(k) == 1}
            if all(consts.get(k) == v for k, v in want.items()) and kernel.metadata.num_stages == stages:
                threads = 32 * kernel.metadata.num_warps
                return {
                    "n_regs": kernel.n_regs,
                    "n_spills": kernel.n_spills,
                    "shared_bytes": kernel.metadata.shared,
                    "num_stages": stages,
                    "programs_per_sm_resident": _occupancy(kernel.function, threads, kernel.metadata.shared),
                    "programs_per_sm_launched": knobs.programs_for(128, head_dim),
                }
    except Exception as exc:  # a diagnostic: report, do not fail the run
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {}


def pool_call(w: object) -> Callable[[], object]:
    """The pipeline's pooling call (K and V) on a workload."""
    return lambda: index_triton.pool_blocks_triton(w.k_cache, w.v_cache, w.batch)


def pair_difference(a: BlockIndex, b: BlockIndex, num_blocks: int) -> int:
    """Number of (segment, block) pairs kept by exactly one of two indexes over the same segments."""
    if a.num_segments != b.num_segments:
        return -1
    return int((a.to_dense_mask(num_blocks) ^ b.to_dense_mask(num_blocks)).sum())


def measure_index(
    impl: ModuleType,
    label: str,
    w: object,
    config: SelectionConfig,
    args: argparse.Namespace,
    device: torch.device,
    *,
    extras: bool,
) -> tuple[dict[str, object], BlockIndex]:
    """Pool, select and index times of one implementation; graph time, host time and profile with ``extras``."""
    q, k_cache, v_cache, batch = w.q, w.k_cache, w.v_cache, w.batch
    workspace = impl.IndexWorkspace(device)

    def pool() -> object:
        return impl.pool_blocks_triton(k_cache, v_cache, batch, block_size=config.block_size)

    stats = pool()

    def select() -> BlockIndex:
        return impl.select_blocks_triton(q, batch, stats, config=config, workspace=workspace)

    def index() -> BlockIndex:
        return impl.select_blocks_triton(q, batch, pool(), config=config, workspace=workspace)

    pool_ms, _ = timed(pool, args, device)
    select_ms, _ = timed(select, args, device)
    index_ms, samples = timed(index, args, device)
    result = index()
    sync(device)
    row: dict[str, object] = {
        "impl": label,
        "probe": config.probe_stride,
        "pool_ms": pool_ms,
        "select_ms": select_ms,
        "index_ms": index_ms,
        "index_samples_ms": samples,
        "density": result.density(batch),
        "nnz": result.nnz,
        "workspace_bytes": workspace.nbytes,
    }
    if extras:
        row["index_graph_ms"] = graph_ms(index, args, device)
        row["index_host_ms"] = host_enqueue_ms(index, device)
        row["profile"] = [] if args.no_profile else kernel_profile(index, device)
    return row, result


def measure_pipeline(
    w: object, config: SelectionConfig, ref: torch.Tensor, args: argparse.Namespace, device: torch.device
) -> dict[str, object]:
    """Whole sparse pipeline (correction on): output error vs fp32 dense and stage medians."""
    pipe = SparsePrefillPipeline(config, correction=True, backend=args.backend)
    stages: list[object] = []

    def collect(result: object, is_timed: bool) -> None:
        if is_timed:
            stages.append(result.timings)

    samples, result = timed_samples(
        lambda: pipe(w.q, w.k_cache, w.v_cache, w.batch), 2, args.pipeline_repeats, device, on_call=collect
    )
    return {
        "pipeline_ms": median(samples),
        "pipeline_index_ms": median([s.index_ms for s in stages]),
        "pipeline_correction_ms": median([s.correction_ms for s in stages]),
        "pipeline_attention_ms": median([s.attention_ms for s in stages]),
        "pipeline_density": result.index.density(w.batch),
        "rel_err": relative_l2_error(result.out, ref),
        "backend": pipe.backend.name,
    }


def fmt(value: object, spec: str) -> str:
    """A table cell (``-`` for missing values)."""
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, object]]) -> str:
    """The main rows as a markdown table."""
    head = "| L | impl | probe | pool ms | select ms | index ms | graph ms | host ms | density | rel err | pipe idx ms"
    head += " |"
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        cells = [
            str(r["L"]),
            str(r["impl"]),
            str(r["probe"]),
            fmt(r.get("pool_ms"), ".3f"),
            fmt(r.get("select_ms"), ".3f"),
            fmt(r.get("index_ms"), ".3f"),
            fmt(r.get("index_graph_ms"), ".3f"),
            fmt(r.get("index_host_ms"), ".3f"),
            fmt(r.get("density"), ".4f"),
            fmt(r.get("rel_err"), ".4f"),
            fmt(r.get("pipeline_index_ms"), ".3f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    args: argparse.Namespace,
    tuning_used: dict[str, object],
    rows: list[dict[str, object]],
    sweep_rows: list[dict[str, object]],
    floors: dict[str, object],
    summary: list[dict[str, object]],
    notes: list[str],
    defaults: dict[str, object],
    commit: str,
    gpu: str,
    device: torch.device,
) -> Path:
    """Write (or rewrite, after each L) ``index-speed.json`` and ``summary.json``; returns the first path."""
    payload = {
        "benchmark": "index_speed",
        "commit": commit,
        "gpu": gpu,
        "environment": environment_record(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "baseline_dir"},
        "selection": {f: getattr(SelectionConfig(alpha=args.alpha), f) for f in SelectionConfig.__dataclass_fields__},
        "tuning_defaults": defaults,
        "tuning_used": tuning_used,
        "workload": "planted",
        "timer": "cuda-events" if device.type == "cuda" else "perf_counter",
        "notes": notes,
        "floor": floors,
        "rows": rows,
        "sweep": sweep_rows,
    }
    path = write_json(args.out / "index-speed.json", sanitize(payload))
    write_json(args.out / "summary.json", sanitize(summary))
    return path


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``).

    Returns:
        The process exit status.
    """
    args = parse_args(argv)
    try:
        device = benchmark_device(args.device)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    notes = protocol_notes(device, args.repeats, "perf_counter times check the plumbing, not benchmark numbers")
    notes.append(
        "index_ms = pool_blocks_triton(K, V) + select_blocks_triton, CUDA events around both; graph_ms = the same "
        "two calls replayed as one CUDA graph (GPU time only); host_ms = host time to issue them"
    )
    if len(score_variants(args, tuning.SCORE)) > 1:
        notes.append(
            "scoring variants (--tiles-per-program / --mma-store / --pair-stages) run one after the other in this "
            "process on the same workload; identical_to_first: same offsets and blocks as the first variant's index"
        )
    baseline = None
    if args.baseline_dir is not None:
        baseline = load_baseline(args.baseline_dir)
        log(f"baseline {args.baseline_label} loaded")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    defaults = {"score": vars(tuning.SCORE).copy(), "pool": vars(tuning.POOL).copy()}

    overheads = launch_overheads(device)
    log(f"host launch overheads: {overheads}")
    notes.append(f"host cost of one launch (us): {overheads}")
    rows: list[dict[str, object]] = []
    sweep_rows: list[dict[str, object]] = []
    floors: dict[str, object] = {}
    summary: list[dict[str, object]] = []
    tuning_used: dict[str, object] = {}
    commit = git_commit()
    gpu = gpu_name(device)
    for seqlen in args.seqlens:
        log(f"building the planted workload L={seqlen}")
        w = planted_workload(
            [seqlen],
            num_q_heads=args.q_heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            page_size=args.page_size,
            fraction=args.fraction,
            margin=args.margin,
            dtype=DTYPES[args.dtype],
            device=device,
            seed=args.seed,
        )
        base = {"L": seqlen, "B": 1, "Hq": args.q_heads, "Hkv": args.kv_heads, "d": args.head_dim}
        full = SelectionConfig(alpha=args.alpha)
        nb = -(-seqlen // full.block_size)
        floors[str(seqlen)] = {
            str(s): index_floor(w.batch, args, SelectionConfig(alpha=args.alpha, probe_stride=s), sms)
            for s in [1, *args.probes]
        }
        ref = None
        if seqlen in args.error_seqlens:
            log("computing the fp32 dense reference")
            ref = dense_attention(w.q.float(), w.k_cache.float(), w.v_cache.float(), w.batch)
        if args.sweep and seqlen in args.sweep_seqlens:
            sweep(w, full, base, args, device, sweep_rows, log)
            if args.auto_tune:
                tuned = best_knobs(sweep_rows, seqlen)
                tuning.set_tuning(**tuned)
                tuning_used[str(seqlen)] = {k: vars(v) for k, v in tuned.items()}
                log(f"auto-tune: {tuning_used[str(seqlen)]}")
        current_index = None  # full-row index of the first variant: what the baseline is compared with
        first_indexes: dict[int, BlockIndex] = {}  # the first variant's index per probe: the identity reference
        knobs_before = tuning.SCORE
        for v, (label, knobs) in enumerate(score_variants(args, knobs_before)):
            impl = "current" if not label else f"current/{label}"
            tuning.set_tuning(score=knobs)
            knobs_now = {"score": vars(tuning.SCORE).copy(), "pool": vars(tuning.POOL).copy()}
            full_row_index = None
            try:
                for probe in [1, *args.probes]:
                    config = SelectionConfig(alpha=args.alpha, probe_stride=probe)
                    log(f"timing {impl}, probe {probe}")
                    try:
                        row, result = measure_index(index_triton, impl, w, config, args, device, extras=probe == 1)
                    except Exception as exc:
                        log(f"{impl} probe {probe} failed: {type(exc).__name__}: {exc}")
                        rows.append({**base, "impl": impl, "probe": probe, "error": f"{type(exc).__name__}: {exc}"})
                        continue
                    row["knobs"] = knobs_now
                    row["variant"] = label or "default"
                    if probe == 1:
                        full_row_index = result
                        if v == 0:
                            current_index = result
                        row["score_kernel"] = score_kernel_report(knobs, args.head_dim, nb, device)
                        if not args.no_host_profile:
                            row["host_profile"] = host_profile(w, config, device)
                    elif full_row_index is not None:
                        row["pairs_differing_from_full_row"] = pair_difference(result, full_row_index, nb)
                    if v == 0:
                        first_indexes[probe] = result
                    elif probe in first_indexes:
                        row["pairs_differing_from_first"] = pair_difference(result, first_indexes[probe], nb)
                        row["identical_to_first"] = identical(result, first_indexes[probe])
                    if ref is not None:
                        log(f"pipeline error, {impl}, probe {probe}")
                        try:
                            row.update(measure_pipeline(w, config, ref, args, device))
                        except Exception as exc:
                            log(f"pipeline failed: {type(exc).__name__}: {exc}")
                            row["pipeline_error"] = f"{type(exc).__name__}: {exc}"
                    rows.append({**base, **row})
                    del result
            finally:
                tuning.set_tuning(score=knobs_before)
            full_row_index = None
        first_indexes.clear()
        if baseline is not None:
            log(f"timing {args.baseline_label}")
            try:
                row, base_index = measure_index(baseline, args.baseline_label, w, full, args, device, extras=True)
                if current_index is not None:
                    row["pairs_differing_from_current"] = pair_difference(current_index, base_index, nb)
                rows.append({**base, **row})
                del base_index
            except Exception as exc:
                log(f"baseline failed: {type(exc).__name__}: {exc}")
        current_index = None
        flops = index_flops([seqlen], [seqlen], args.q_heads, args.head_dim, full.block_size)
        for r in rows:
            if r["L"] == seqlen and "index_ms" in r:
                impl = "fpv2-index" if r["impl"] == "current" else f"fpv2-index/{r['impl'].removeprefix('current/')}"
                if r["probe"] != 1:
                    impl += f"/probe{r['probe']}"
                summary.append(
                    {
                        "impl": impl,
                        "dtype": args.dtype,
                        "B": 1,
                        "L": seqlen,
                        "Hq": args.q_heads,
                        "Hkv": args.kv_heads,
                        "d": args.head_dim,
                        "page_size": args.page_size,
                        "workload": "planted",
                        "ms": r["index_ms"],
                        "index_ms": r["index_ms"],
                        "correction": False,
                        "density": r["density"],
                        "rel_err": None,  # the index alone; the pipeline's error is in index-speed.json
                        "tflops": tflops(flops / r["probe"], r["index_ms"]),
                        "commit": commit,
                        "gpu": gpu,
                    }
                )
        for r in rows:
            if r["L"] == seqlen:
                print(table([r]).splitlines()[-1], flush=True)
        write_results(args, tuning_used, rows, sweep_rows, floors, summary, notes, defaults, commit, gpu, device)
        w = ref = None  # free the workload before the next L

    json_path = write_results(
        args, tuning_used, rows, sweep_rows, floors, summary, notes, defaults, commit, gpu, device
    )
    text = table(rows)
    print(text)
    for r in rows:
        if r.get("profile"):
            print(f"\nL={r['L']} {r['impl']}: GPU time per kernel of one index call (us)")
            for p in r["profile"][:8]:
                print(f"  {p['us']:9.1f}  x{p['calls']:.0f}  {p['kernel']}")
    for r in rows:
        if r.get("host_profile"):
            print(f"\nL={r['L']} {r['impl']}: host time per index call by function (cProfile, us; self / cumulative)")
            for p in r["host_profile"][:10]:
                print(f"  {p['self_us']:8.1f} {p['cumulative_us']:8.1f}  x{p['calls_per_index']:.0f}  {p['function']}")
    for r in rows:
        if "identical_to_first" in r:
            print(
                f"L={r['L']} {r['impl']} probe {r['probe']}: index identical to the first variant's: "
                f"{r['identical_to_first']} ({r['pairs_differing_from_first']} pairs differ)"
            )
    for r in rows:
        if r.get("score_kernel"):
            print(f"L={r['L']} {r['impl']}: scoring kernel {r['score_kernel']}")
    for r in sweep_rows:
        print(f"sweep L={r['L']} {r['kernel']} {r['knobs']}: {r.get('select_ms', r.get('pool_ms', r.get('error')))}")
    for seqlen, by_probe in floors.items():
        f = by_probe["1"]
        print(
            f"floor L={seqlen}: Q read {f['q_read_ms']:.3f} ms, K+V pool read {f['kv_pool_read_ms']:.3f} ms, "
            f"GEMM {f['gemm_ms']:.3f} ms, exp2 {f['exp2_ms']:.3f} ms"
        )
    log(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
