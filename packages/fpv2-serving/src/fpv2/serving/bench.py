"""``fpv2 bench``: time and check the sparse pipeline on a planted workload (protocol: BENCHMARKS.md).

One run builds the planted (or needle) workload, computes the fp32 dense
reference once, times the backend's own dense mode (the ``dense`` strategy),
the torch SDPA baselines on CUDA, and the sparse pipeline for every alpha,
then writes a results JSON, ``summary.json`` and a selection heatmap.
``sparse_only`` skips the dense mode and the SDPA baselines (a series of
record rows at long context then costs seconds a row, not minutes).
"""

from __future__ import annotations

import datetime as _dt
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel.reference.attention import dense_attention
from fpv2.kernel.testing import PlantedWorkload, planted_workload

from .backends import resolve_backend
from .baselines import sdpa_baselines
from .environment import environment_record, git_commit, gpu_clock_state, gpu_name
from .heatmap import SelectionPanel, write_selection_heatmap
from .metrics import dense_causal_flops, index_flops, relative_l2_error, select_rows, tflops
from .pipeline import DENSE_STRATEGY, PrefillResult, SparsePrefillPipeline
from .report import render_table, summary_record, write_json
from .timing import StageTimings, host_ahead_samples, median, timed_samples, warm_for

#: ``--dtype`` names and the element type of the timed inputs.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
#: How to read the numbers of a results file (written into it).
RESULT_NOTES = (
    "ms: median wall time; fpv2-sparse ms is the whole pipeline (index + correction plan + attention); "
    "fpv2-dense ms is its attention stage (the dense mode needs no selection)",
    "tflops: dense-equivalent 4 B Hq L^2 d / 2 / time, except fpv2-index rows (see tflops_basis)",
    "rel_err: relative L2 error vs fp32 dense attention over all rows; needle_rel_err over the needle rows",
    "density: kept / causally visible (tile, block) pairs, in selection blocks",
    "gpu_ms (CUDA only): median of the same calls timed with the host ahead of the GPU, as inside a model's "
    "forward pass: a spin kernel holds the stream while the host issues the call, so the events time the GPU "
    "work alone (gpu_index_ms etc. its stages; a call is redone with a longer spin until the host kept up); "
    "ms also counts the host time the idle GPU waits for before and between the call's launches",
)
#: Fewest timed runs the protocol accepts on a GPU.
MIN_GPU_REPEATS = 10


@dataclass(frozen=True)
class BenchConfig:
    """Everything one ``fpv2 bench`` run needs (the CLI fills device-dependent defaults)."""

    batch: int
    seqlen: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    alphas: tuple[float, ...]
    fraction: float
    margin: float
    dtype: str
    correction: bool
    ablation: bool
    strategy: str
    backend: str
    min_sparse_kv_len: int | None
    repeats: int
    warmup: int
    seed: int
    device: str
    out: Path
    heatmap_head: int
    needle: bool
    progress: bool = True
    #: Milliseconds each timed implementation first runs on its own calls (:func:`~fpv2.serving.timing.warm_for`,
    #: GPU only), before the ``warmup`` calls; 0 keeps the call-count warm-up alone.
    warmup_ms: float = 0.0
    #: ``paged`` (a contiguous paged cache per K and V) or ``vllm`` (vLLM 0.33's strided K/V views of one
    #: layer buffer in its default token-major order, :func:`~fpv2.serving.adapters.vllm_kv_cache.paged_as_kv_cache`).
    cache_layout: str = "paged"
    #: None for BENCHMARKS.md's N(0, 1) background; a correlation length in tokens for the drifting one
    #: (:mod:`fpv2.kernel.testing.drifting`).
    drift_tokens: float | None = None
    #: Mass shifts of the corrected runs (:data:`fpv2.serving.pipeline.MASS_SHIFTS`): one corrected run per shift.
    mass_shifts: tuple[str, ...] = ("mean",)
    #: Time the sparse runs alone: no own dense mode and no SDPA baselines, so the speedup columns stay empty.
    sparse_only: bool = False

    @property
    def workload(self) -> str:
        """Workload name of the records: ``planted`` or ``needle``, ``drifting`` or ``drifting-needle``."""
        name = "needle" if self.needle else "planted"
        if self.drift_tokens is None:
            return name
        return "drifting" if name == "planted" else f"drifting-{name}"

    @property
    def tag(self) -> str:
        """File-name tag of this configuration."""
        layout = "" if self.cache_layout == "paged" else f"-{self.cache_layout}"
        return (
            f"{self.dtype}-B{self.batch}-L{self.seqlen}-Hq{self.q_heads}-Hkv{self.kv_heads}-d{self.head_dim}"
            f"-p{self.page_size}{layout}-{self.workload}"
        )

    def corrections(self) -> tuple[bool, ...]:
        """Correction settings to run for each alpha."""
        return (True, False) if self.ablation else (self.correction,)

    def sparse_runs(self) -> list[tuple[float, bool, str | None]]:
        """``(alpha, correction, mass shift or None)`` of every sparse run: each corrected run once per shift."""
        return [
            (alpha, correction, shift)
            for alpha in self.alphas
            for correction in self.corrections()
            for shift in (self.mass_shifts if correction else (None,))
        ]


@dataclass
class BenchOutcome:
    """What a bench run produced."""

    rows: list[dict[str, object]]
    summary: list[dict[str, object]]
    results_path: Path
    summary_path: Path
    heatmap_path: Path | None
    notes: list[str] = field(default_factory=list)


@dataclass
class _Inputs:
    """The timed inputs (possibly FP8) next to the workload they came from."""

    workload: PlantedWorkload
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    descales: dict[str, torch.Tensor]


def _prepare_inputs(cfg: BenchConfig, device: torch.device) -> _Inputs:
    """Build the workload; FP8 runs quantise a bf16 workload with per (request, KV head) descales."""
    source = torch.bfloat16 if cfg.dtype == "fp8" else DTYPES[cfg.dtype]
    wl = planted_workload(
        [cfg.seqlen] * cfg.batch,
        num_q_heads=cfg.q_heads,
        num_kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        page_size=cfg.page_size,
        fraction=cfg.fraction,
        margin=cfg.margin,
        needle=cfg.needle,
        drift_tokens=cfg.drift_tokens,
        dtype=source,
        device=device,
        seed=cfg.seed,
    )
    if cfg.dtype != "fp8":
        return _Inputs(wl, wl.q, *_in_layout(wl.k_cache, wl.v_cache, cfg.cache_layout), {})
    from fpv2.kernel.reference.fp8 import quantize_cache, quantize_queries

    q8, qd = quantize_queries(wl.q, wl.batch, cfg.kv_heads)
    k8, kd = quantize_cache(wl.k_cache, wl.batch)
    v8, vd = quantize_cache(wl.v_cache, wl.batch)
    k8, v8 = _in_layout(k8, v8, cfg.cache_layout)
    return _Inputs(wl, q8, k8, v8, {"q_descale": qd, "k_descale": kd, "v_descale": vd})


def _in_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as the layout has them: as they are (``paged``), or as vLLM's views of one buffer (``vllm``)."""
    if layout == "paged":
        return k_cache, v_cache
    from .adapters.vllm_kv_cache import kv_cache_views, paged_as_kv_cache

    return kv_cache_views(paged_as_kv_cache(k_cache, v_cache), k_cache.shape[-1])  # vLLM's default order (NHD)


def _kernel_that_ran(backend: object) -> str:
    """The backend that served the last call (a fallback backend records it), else the backend's name."""
    choice = getattr(backend, "last_choice", None)
    return choice[0] if choice else str(getattr(backend, "name", backend))


def _kv_layout_that_ran(backend: object) -> str | None:
    """How the last call's K/V reached the kernel (``paged`` or ``tile-repack``), for backends that record it."""
    return getattr(backend, "last_kv_layout", None)


@dataclass
class _Measured:
    """The samples of one row: eager (host time the GPU waits for included) and host-ahead (GPU only)."""

    samples: list[float]
    stages: list[StageTimings]
    result: object
    gpu_samples: list[float] | None = None
    gpu_stages: list[StageTimings] = field(default_factory=list)
    host_ahead_tried: bool = False
    #: The GPU's clock and power before the timed calls and after the host-ahead ones (CUDA only).
    clock: dict[str, object] | None = None

    def gpu_fields(self, *, stage_ms: str | None = None) -> dict[str, object]:
        """The row's host-ahead columns (``gpu_ms`` the whole call, or the stage ``stage_ms``), or ``{}``."""
        clock = {"gpu_clock": self.clock} if self.clock is not None else {}
        if self.gpu_samples is None:
            if self.host_ahead_tried:  # never silently absent on a GPU
                return {"gpu_ms": None, "gpu_note": "the host never got ahead: the call waits on the GPU", **clock}
            return clock
        split = _stage_medians(self.gpu_stages) if self.gpu_stages else {}
        ms = split[stage_ms] if stage_ms is not None else median(self.gpu_samples)
        gpu = {f"gpu_{k}": v for k, v in split.items()}
        return {"gpu_ms": ms, "gpu_samples_ms": self.gpu_samples, **gpu, **clock}


def _measure(fn: Callable[[], object], cfg: BenchConfig, device: torch.device, tick: Callable[[], None]) -> _Measured:
    """Warm up (on CUDA first for ``cfg.warmup_ms``), time ``cfg.repeats`` calls, then (on CUDA) ``cfg.repeats``
    more with the host ahead."""
    stages: list[StageTimings] = []
    gpu_stages: list[StageTimings] = []

    def collect(into: list[StageTimings]) -> Callable[[object, bool], None]:
        def after_call(result: object, timed: bool) -> None:
            if timed and isinstance(result, PrefillResult):
                into.append(result.timings)
            tick()

        return after_call

    if device.type == "cuda" and cfg.warmup_ms > 0:
        warm_for(fn, cfg.warmup_ms, device)
    before = gpu_clock_state(device)
    samples, result = timed_samples(fn, cfg.warmup, cfg.repeats, device, on_call=collect(stages))
    if device.type != "cuda":
        return _Measured(samples, stages, result)
    result = None  # free the output before the host-ahead calls allocate theirs
    gpu_samples, result = host_ahead_samples(fn, cfg.repeats, device, on_call=collect(gpu_stages))
    clock = {"before": before, "after": gpu_clock_state(device)}
    return _Measured(samples, stages, result, gpu_samples, gpu_stages if gpu_samples is not None else [], True, clock)


def _speedup(dense_ms: float | None, ms: float) -> float | None:
    """Own dense time over this row's (None without a dense row or a time)."""
    return dense_ms / ms if dense_ms is not None and ms > 0 else None


def _measure_pipeline(
    pipe: SparsePrefillPipeline, inputs: _Inputs, cfg: BenchConfig, device: torch.device, tick: Callable[[], None]
) -> tuple[_Measured, PrefillResult, dict[str, float]]:
    """:func:`_measure` of one pipeline on the bench inputs: the samples, the last result and the stage medians."""
    batch = inputs.workload.batch
    measured = _measure(
        lambda: pipe(inputs.q, inputs.k_cache, inputs.v_cache, batch, **inputs.descales), cfg, device, tick
    )
    result = measured.result
    assert isinstance(result, PrefillResult)
    return measured, result, _stage_medians(measured.stages)


def _gpu_speedup(dense_gpu: dict[str, object], gpu: dict[str, object]) -> dict[str, object]:
    """``gpu_speedup``: own dense over this row, both timed with the host ahead (``{}`` without both)."""
    if dense_gpu.get("gpu_ms") is None or gpu.get("gpu_ms") is None:
        return {}
    ms = float(gpu["gpu_ms"])  # type: ignore[arg-type]
    return {"gpu_speedup": float(dense_gpu["gpu_ms"]) / ms if ms > 0 else None}  # type: ignore[arg-type]


def _stage_medians(stages: list[StageTimings]) -> dict[str, float]:
    return {
        "index_ms": median([s.index_ms for s in stages]),
        "correction_ms": median([s.correction_ms for s in stages]),
        "attention_ms": median([s.attention_ms for s in stages]),
    }


def run_bench(cfg: BenchConfig, *, echo: Callable[[str], None] = print, console: object | None = None) -> BenchOutcome:
    """Run one benchmark configuration and write its files under ``cfg.out``.

    Args:
        cfg: the configuration (validated by the CLI).
        echo: where progress notes are printed.
        console: a ``rich.console.Console`` for the final table (None: a new one on stdout).

    Returns:
        The :class:`BenchOutcome` (rows, summary records, written paths).

    Raises:
        ValueError: unknown strategy or backend.
        RuntimeError: the named backend is not available.
    """
    from rich.console import Console
    from tqdm import tqdm

    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # timing events record on the current device
    backend = resolve_backend(cfg.backend)
    notes: list[str] = []
    timer = "cuda-events" if device.type == "cuda" else "perf_counter"
    if device.type != "cuda":
        notes.append(
            f"CPU run: {cfg.repeats} timed runs after {cfg.warmup} warm-up (perf_counter); CPU times check the "
            "plumbing, they are not benchmark numbers"
        )
    elif cfg.repeats < MIN_GPU_REPEATS:
        notes.append(f"only {cfg.repeats} timed runs: the protocol asks for >= {MIN_GPU_REPEATS}")
    for note in notes:
        echo(f"note: {note}")

    echo(f"building the {cfg.workload} workload ({cfg.tag}, seed {cfg.seed}) on {device}")
    inputs = _prepare_inputs(cfg, device)
    wl, batch = inputs.workload, inputs.workload.batch
    echo("computing the fp32 dense reference")
    # The reference casts each request's operands to fp32 itself: no fp32 copy of the whole batch (12 GiB at 4 x 128K).
    ref = dense_attention(wl.q, wl.k_cache, wl.v_cache, batch, compute_dtype=torch.float32)
    needle_ref = select_rows(ref, batch, wl.needle_rows) if cfg.needle else None

    lens = [cfg.seqlen] * cfg.batch
    dense_flops = dense_causal_flops(lens, lens, cfg.q_heads, cfg.head_dim)
    baselines, baseline_notes = (
        sdpa_baselines(wl.q, wl.k_cache, wl.v_cache, batch)
        if device.type == "cuda" and not cfg.sparse_only
        else ([], [])
    )
    if cfg.sparse_only:
        notes.append("sparse runs only: no own dense mode and no SDPA baselines, so no speedup columns")
    for note in baseline_notes:
        echo(f"note: {note}")
    notes += baseline_notes

    def config_for(alpha: float) -> SelectionConfig:
        kwargs: dict[str, object] = {"alpha": alpha}
        if cfg.min_sparse_kv_len is not None:
            kwargs["min_sparse_kv_len"] = cfg.min_sparse_kv_len
        return SelectionConfig(**kwargs)

    sparse_runs = cfg.sparse_runs()
    host_ahead_runs = cfg.repeats if device.type == "cuda" else 0
    dense_runs = 0 if cfg.sparse_only else 1
    total_runs = (cfg.warmup + cfg.repeats + host_ahead_runs) * (dense_runs + len(baselines) + len(sparse_runs))
    bar = tqdm(total=total_runs, desc="fpv2 bench", unit="run", disable=not cfg.progress, mininterval=1.0)
    commit, gpu = git_commit(), gpu_name(device)
    common = {
        "dtype": cfg.dtype,
        "B": cfg.batch,
        "L": cfg.seqlen,
        "Hq": cfg.q_heads,
        "Hkv": cfg.kv_heads,
        "d": cfg.head_dim,
        "page_size": cfg.page_size,
        "cache_layout": cfg.cache_layout,
        "workload": cfg.workload,
        "commit": commit,
        "gpu": gpu,
        "backend": backend.name,
        "timer": timer,
        "repeats": cfg.repeats,
        "warmup_ms": cfg.warmup_ms if device.type == "cuda" else 0.0,
    }

    def needle_error(out: torch.Tensor) -> float | None:
        if needle_ref is None or needle_ref.numel() == 0:
            return None
        return relative_l2_error(select_rows(out, batch, wl.needle_rows), needle_ref)

    rows: list[dict[str, object]] = []
    panels: list[SelectionPanel] = []
    try:
        dense_ms: float | None = None  # stays None with sparse_only: no speedup columns
        dense_gpu: dict[str, object] = {}
        if not cfg.sparse_only:
            # The backend's own dense mode: every visible block, no correction.
            dense_pipe = SparsePrefillPipeline(
                config_for(cfg.alphas[0]), strategy=DENSE_STRATEGY, correction=False, backend=backend
            )
            bar.set_postfix_str("fpv2 dense")
            measured, result, split = _measure_pipeline(dense_pipe, inputs, cfg, device, bar.update)
            samples = measured.samples
            dense_gpu = measured.gpu_fields(stage_ms="attention_ms")
            dense_ms = split["attention_ms"]  # the dense mode needs no selection: time its attention stage
            rows.append(
                {
                    **common,
                    "impl": f"fpv2-dense/{_kernel_that_ran(backend)}",
                    "kv_layout": _kv_layout_that_ran(backend),
                    "strategy": DENSE_STRATEGY,
                    "alpha": None,
                    "correction": False,
                    "ms": dense_ms,
                    "pipeline_ms": median(samples),
                    "samples_ms": samples,
                    **split,
                    "density": float(result.index.density(batch)),
                    "rel_err": relative_l2_error(result.out, ref),
                    "needle_rel_err": needle_error(result.out),
                    "tflops": tflops(dense_flops, dense_ms),
                    "speedup": 1.0,
                    **dense_gpu,
                }
            )
            del result, measured

        for base in baselines:
            bar.set_postfix_str(base.impl)
            measured = _measure(base.call, cfg, device, bar.update)
            samples, out = measured.samples, measured.result
            assert isinstance(out, torch.Tensor)
            gpu_timing = measured.gpu_fields()
            packed = base.packed(out)
            ms = median(samples)
            rows.append(
                {
                    **common,
                    "impl": base.impl,
                    "dtype": "bf16" if base.dtype == torch.bfloat16 else "fp16",
                    "backend": "torch-sdpa",
                    "sdpa_note": base.note,
                    "strategy": None,
                    "alpha": None,
                    "correction": False,
                    "ms": ms,
                    "samples_ms": samples,
                    "index_ms": None,
                    "density": None,
                    "rel_err": relative_l2_error(packed, ref),
                    "needle_rel_err": needle_error(packed),
                    "tflops": tflops(dense_flops, ms),
                    "speedup": _speedup(dense_ms, ms),
                    **gpu_timing,
                    **_gpu_speedup(dense_gpu, gpu_timing),
                }
            )
            del out, packed, measured

        for alpha, correction, shift in sparse_runs:
            pipe = SparsePrefillPipeline(
                config_for(alpha),
                strategy=cfg.strategy,
                correction=correction,
                backend=backend,
                mass_shift=shift or "mean",
            )
            label = f"on ({shift})" if correction and shift != "mean" else "on" if correction else "off"
            bar.set_postfix_str(f"alpha={alpha:g} correction={label}")
            measured, result, split = _measure_pipeline(pipe, inputs, cfg, device, bar.update)
            samples = measured.samples
            gpu_timing = measured.gpu_fields()
            ms = median(samples)
            density = float(result.index.density(batch))
            row = {
                **common,
                "impl": f"fpv2-sparse/{_kernel_that_ran(backend)}",
                "kv_layout": _kv_layout_that_ran(backend),
                "strategy": cfg.strategy,
                "alpha": alpha,
                "correction": correction,
                "mass_shift": shift,
                "ms": ms,
                "samples_ms": samples,
                **split,
                "density": density,
                "rel_err": relative_l2_error(result.out, ref),
                "needle_rel_err": needle_error(result.out),
                "tflops": tflops(dense_flops, ms),
                "speedup": _speedup(dense_ms, ms),
                "dense_scaled_ms": density * dense_ms if dense_ms is not None else None,
                **gpu_timing,
                **_gpu_speedup(dense_gpu, gpu_timing),
            }
            rows.append(row)
            rows.append(
                {
                    **common,
                    "impl": "fpv2-index",
                    "strategy": cfg.strategy,
                    "alpha": alpha,
                    "correction": correction,
                    "mass_shift": shift,
                    "ms": split["index_ms"],
                    "index_ms": split["index_ms"],
                    "density": density,
                    "rel_err": None,
                    "tflops": tflops(
                        index_flops(lens, lens, cfg.q_heads, cfg.head_dim, result.index.block_size), split["index_ms"]
                    ),
                    "tflops_basis": "index scoring FLOPs (2 Hq Lq Lk d / Bk / 2), not dense-equivalent",
                    **(
                        {"gpu_ms": gpu_timing.get("gpu_index_ms"), "gpu_index_ms": gpu_timing.get("gpu_index_ms")}
                        if gpu_timing
                        else {}
                    ),
                }
            )
            panels.append(SelectionPanel(f"alpha={alpha:g}, correction {label}, density {density:.3f}", result.index))
            del result, measured
    finally:
        bar.close()

    cfg.out.mkdir(parents=True, exist_ok=True)
    heatmap_path = None
    if panels:
        planted = wl.planted_blocks[0][cfg.heatmap_head]
        heatmap_path = write_selection_heatmap(
            cfg.out / f"selection-{cfg.tag}.png",
            panels,
            batch,
            kv_head=cfg.heatmap_head,
            planted=planted,
            title=f"kept blocks of request 0, KV head {cfg.heatmap_head}\n{cfg.tag}, strategy {cfg.strategy}",
        )
    summary = [summary_record(row) for row in rows]
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    payload = {
        "schema": "fpv2-bench/1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **environment_record(),
        "gpu": gpu,
        "device": str(device),
        "config": config,
        "notes": [*notes, *RESULT_NOTES],
        "rows": rows,
    }
    results_path = write_json(cfg.out / f"bench-{cfg.tag}.json", payload)
    summary_path = write_json(cfg.out / "summary.json", summary)
    # A log is not a terminal: give the table room instead of rich's 80-column default.
    shown = console if console is not None else Console(width=max(140, shutil.get_terminal_size().columns))
    shown.print(render_table(rows, title=f"fpv2 bench {cfg.tag} on {gpu} ({timer})"))  # type: ignore[attr-defined]
    shown.print(f"wrote {results_path}, {summary_path}" + (f", {heatmap_path}" if heatmap_path else ""))  # type: ignore[attr-defined]
    return BenchOutcome(rows, summary, results_path, summary_path, heatmap_path, notes)
