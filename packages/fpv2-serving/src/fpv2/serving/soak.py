"""Soak: many pipeline calls of varying batch composition; memory, index workspace and host syncs per call.

A serving engine calls the prefill pipeline millions of times with batches
that never look alike. :func:`run_soak` replays that on one device: a seeded
schedule of calls (:func:`draw_compositions`: 1..``max_batch`` requests,
KV lengths 1..``max_len``, random cached prefixes, zero-length requests,
page sizes alternating between calls) over one KV cache buffer viewed with
each page size, and records after every call:

- memory: on CUDA ``torch.cuda.memory_allocated`` / ``memory_reserved`` (and
  the call's peak), and the process RSS (``/proc/self/statm``; the verdict on
  the CPU, informative on CUDA), read after the call's outputs are dropped;
- the fused Triton index's workspace: the bytes held by every
  :class:`fpv2.index.triton.IndexWorkspace` the call reserved
  (:class:`WorkspaceProbe` wraps ``IndexWorkspace.reserve`` while the soak
  runs), next to the size its documented formula
  (:meth:`IndexWorkspace.required_bytes`) gives for the call's lengths;
- host synchronisations made inside the pipeline call (:class:`SyncCounter`).

:func:`summarise` turns the records into the verdicts: memory growth over the
last ``steady_fraction`` of the calls against a bound, the largest workspace
against the formula at the largest composition, and syncs per call in steady
state with the code locations that make them.

How syncs are counted, and the limits of it
-------------------------------------------
``torch.cuda.set_sync_debug_mode("warn")`` makes PyTorch warn whenever one of
its operations synchronises the host with the device: device-to-host copies
(``.cpu()``, ``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``), blocking
host-to-device copies (``torch.tensor(list, device="cuda")``), ops whose output
size depends on device data (``nonzero``, ``repeat_interleave`` without
``output_size``), explicit stream/device synchronisations. :class:`SyncCounter`
counts those warnings and records, for each, the innermost ``fpv2`` frames of
the Python stack. Not seen by it: ``torch.cuda.Event.synchronize`` (used only
when timings are read), syncs inside Triton's launcher or the CUDA driver
(first-call compilation, module loading: warm-up only), ``cudaMalloc``/``cudaFree``
of the caching allocator when it grows or frees (implicit device syncs), and
syncs in native (non-PyTorch) code such as the Hopper backend's C ABI. The
count is therefore a lower bound of real host/device synchronisations, exact
for the PyTorch operations the pipeline issues.

Expected on the fast path (Triton index + Triton attention, correction on,
host view seeded): :data:`EXPECTED_FAST_PATH_SYNCS`, none. The pipeline records
each index it builds with a built-in strategy as built for its batch
(:meth:`fpv2.kernel.BlockIndex.assume_compatible`), so the kernel's index check
reads nothing back; the Triton index sizes its output from the host view and
spare capacity; the correction plan's block offsets are checked on the host
side by the kernel (``fpv2.kernel.triton``). ``batch.host`` adds 1 when the
engine does not seed the host view (both length arrays in one copy).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from fpv2.index import SelectionConfig, get_strategy
from fpv2.index.triton.workspace import IndexWorkspace
from fpv2.kernel import PagedPrefillBatch
from fpv2.kernel.contracts import HostBatchView, num_key_blocks, num_query_tiles

from .backends import AUTO, output_dtype

#: Schema tag of soak result files.
SOAK_SCHEMA = "fpv2-soak/1"
#: Text of PyTorch's sync debug warning.
SYNC_WARNING = "called a synchronizing CUDA operation"
#: Element types by name.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Host syncs per pipeline call expected on the fast path, by site (none: the target of the soak).
EXPECTED_FAST_PATH_SYNCS: dict[str, int] = {}
#: Most host syncs per call the soak accepts in steady state (a regression beyond this fails it).
MAX_SYNCS_PER_CALL = sum(EXPECTED_FAST_PATH_SYNCS.values())
#: Default growth bounds over the steady window (bytes).
ALLOCATED_GROWTH_BOUND = 1 << 20
RESERVED_GROWTH_BOUND = 256 << 20
RSS_GROWTH_BOUND = 64 << 20

PipelineFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedPrefillBatch], object]


# ---------------------------------------------------------------------------- config
def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SoakConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"SoakConfig.{name} must be >= {minimum}, got {value}")


def _check_fraction(name: str, value: object, *, open_low: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SoakConfig.{name} must be a float, got {type(value).__name__} {value!r}")
    if not (0.0 <= value <= 1.0) or (open_low and value == 0.0):
        raise ValueError(f"SoakConfig.{name} must lie in {'(0' if open_low else '[0'}, 1], got {value}")


@dataclass(frozen=True)
class SoakConfig:
    """What one soak run does (defaults: the GPU run of the issue).

    Attributes:
        calls: pipeline calls (10,000 on the GPU).
        max_batch: largest number of requests in a call (each call draws 1..max_batch).
        max_len: largest KV length of a request (each draws 1..max_len).
        page_sizes: page sizes, one drawn per call over views of one KV buffer.
        prefix_probability: chance that a request sits on a random cached prefix.
        empty_probability: chance that a request has no new queries (prefix only);
            every call keeps at least one request with queries.
        q_heads: ``Hq``.
        kv_heads: ``Hkv``.
        head_dim: ``d``.
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        alpha: selection alpha.
        min_sparse_kv_len: selection short-request threshold (None: the config default).
        sink_tokens: selection sink (None: default).
        window_tokens: selection window (None: default).
        strategy: selection strategy.
        correction: mean correction on.
        backend: attention backend name (``auto``: the default backend).
        routed: run :class:`fpv2.serving.routing.RoutedPrefillPipeline` instead of the plain pipeline.
        routing_table: routing table file for ``routed`` (None: the default rule).
        seed: schedule and data seed.
        steady_fraction: share of the calls, at the end, judged as steady state (0.9: the last 90%).
        worst_case_first: start with one call per page size at the largest composition
            (``max_batch`` requests of ``max_len`` tokens), so the steady window never meets
            a larger call than warm-up did.
        seed_host_view: give each batch its host lengths (as engines do); False lets the
            pipeline read them from the device (``batch.host``, one sync per call).
        count_syncs: count host syncs (CUDA only).
        check_every: check the output is finite every this many calls (0: never; outside the counted window).
        allocated_growth_bound: CUDA allocated bytes the steady window may grow by.
        reserved_growth_bound: CUDA reserved bytes the steady window may grow by.
        rss_growth_bound: process RSS bytes the steady window may grow by (CPU runs).
        max_syncs_per_call: most syncs per steady call before the soak fails (None: no limit).
        time_limit_s: stop drawing calls once this many seconds have passed (None: run all
            ``calls``); the summary then covers the calls made and says so. For a device
            whose time is metered: as many calls as fit.

    Raises:
        TypeError, ValueError: a field of the wrong type or out of range.
    """

    calls: int = 10_000
    max_batch: int = 8
    max_len: int = 16384
    page_sizes: tuple[int, ...] = (1, 16, 64)
    prefix_probability: float = 0.3
    empty_probability: float = 0.05
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    alpha: float = 0.1
    min_sparse_kv_len: int | None = None
    sink_tokens: int | None = None
    window_tokens: int | None = None
    strategy: str = "max_threshold"
    correction: bool = True
    backend: str = AUTO
    routed: bool = False
    routing_table: str | None = None
    seed: int = 0
    steady_fraction: float = 0.9
    worst_case_first: bool = True
    seed_host_view: bool = True
    count_syncs: bool = True
    check_every: int = 0
    allocated_growth_bound: int = ALLOCATED_GROWTH_BOUND
    reserved_growth_bound: int = RESERVED_GROWTH_BOUND
    rss_growth_bound: int = RSS_GROWTH_BOUND
    max_syncs_per_call: int | None = MAX_SYNCS_PER_CALL
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        for name, minimum in (
            ("calls", 1),
            ("max_batch", 1),
            ("max_len", 1),
            ("q_heads", 1),
            ("kv_heads", 1),
            ("head_dim", 1),
            ("seed", 0),
            ("check_every", 0),
            ("allocated_growth_bound", 0),
            ("reserved_growth_bound", 0),
            ("rss_growth_bound", 0),
        ):
            _check_int(name, getattr(self, name), minimum)
        if self.max_syncs_per_call is not None:
            _check_int("max_syncs_per_call", self.max_syncs_per_call, 0)
        if self.time_limit_s is not None:
            limit = self.time_limit_s
            if isinstance(limit, bool) or not isinstance(limit, (int, float)):
                raise TypeError(f"SoakConfig.time_limit_s must be a number or None, got {type(limit).__name__}")
            if not (math.isfinite(limit) and limit > 0):
                raise ValueError(f"SoakConfig.time_limit_s must be positive and finite, got {limit}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"SoakConfig.q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}")
        pages = tuple(self.page_sizes)
        if not pages:
            raise ValueError("SoakConfig.page_sizes must name at least one page size")
        for p in pages:
            _check_int("page_sizes[]", p, 1)
        object.__setattr__(self, "page_sizes", pages)
        _check_fraction("prefix_probability", self.prefix_probability)
        _check_fraction("empty_probability", self.empty_probability)
        if self.prefix_probability + self.empty_probability > 1.0:
            raise ValueError("SoakConfig.prefix_probability + empty_probability must be <= 1")
        _check_fraction("steady_fraction", self.steady_fraction, open_low=True)
        if self.dtype not in DTYPES:
            raise ValueError(f"SoakConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.selection()  # validates alpha and the optional selection fields

    @classmethod
    def for_cpu(cls, **overrides: object) -> SoakConfig:
        """A soak small enough for the CPU reference backend (RSS instead of CUDA memory).

        Args:
            **overrides: fields to change.

        Returns:
            The config: 50 calls of up to 4 requests of up to 640 tokens, 4/2 heads, d=64, fp32,
            the reference backend, small sinks/windows so that blocks are pruned.
        """
        base: dict[str, object] = {
            "calls": 50,
            "max_batch": 4,
            "max_len": 640,
            "q_heads": 4,
            "kv_heads": 2,
            "head_dim": 64,
            "dtype": "fp32",
            "backend": "reference",
            "min_sparse_kv_len": 0,
            "sink_tokens": 128,
            "window_tokens": 128,
        }
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    def selection(self) -> SelectionConfig:
        """The selection parameters of the soaked pipeline.

        Returns:
            The :class:`fpv2.index.SelectionConfig`.
        """
        kwargs: dict[str, object] = {"alpha": self.alpha}
        for name in ("min_sparse_kv_len", "sink_tokens", "window_tokens"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return SelectionConfig(**kwargs)

    @property
    def steady_start(self) -> int:
        """Index of the first call of the steady window."""
        return self.calls - max(1, math.ceil(self.steady_fraction * self.calls))


# ------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class Composition:
    """The shape of one call's batch.

    Attributes:
        page_size: KV cache page size of the call.
        q_lens: new queries per request.
        kv_lens: KV length per request (prefix included).
    """

    page_size: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def prefixes(self) -> int:
        """Requests with a cached prefix and new queries."""
        return sum(1 for q, k in zip(self.q_lens, self.kv_lens) if 0 < q < k)

    @property
    def empties(self) -> int:
        """Requests without new queries."""
        return sum(1 for q in self.q_lens if q == 0)


def draw_compositions(cfg: SoakConfig) -> Iterator[Composition]:
    """The seeded schedule of ``cfg.calls`` compositions.

    Args:
        cfg: the soak configuration.

    Yields:
        One :class:`Composition` per call: the worst case per page size first (if asked),
        then random ones.
    """
    rng = random.Random(cfg.seed)
    emitted = 0
    if cfg.worst_case_first:
        for page_size in cfg.page_sizes:
            if emitted == cfg.calls:
                return
            lens = (cfg.max_len,) * cfg.max_batch
            yield Composition(page_size, lens, lens)
            emitted += 1
    while emitted < cfg.calls:
        batch = rng.randint(1, cfg.max_batch)
        q_lens, kv_lens = [], []
        for _ in range(batch):
            kv = rng.randint(1, cfg.max_len)
            draw = rng.random()
            if draw < cfg.empty_probability:
                q = 0
            elif draw < cfg.empty_probability + cfg.prefix_probability and kv > 1:
                q = kv - rng.randint(1, kv - 1)
            else:
                q = kv
            q_lens.append(q)
            kv_lens.append(kv)
        if not any(q_lens):  # an engine never prefills nothing
            q_lens[0] = kv_lens[0]
        yield Composition(rng.choice(cfg.page_sizes), tuple(q_lens), tuple(kv_lens))
        emitted += 1


# ------------------------------------------------------------------------- probes
def current_rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc/self/statm``), or None where unavailable.

    Returns:
        Bytes, or None.
    """
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _fpv2_frames(stack: list[traceback.FrameSummary], skip: str) -> list[str]:
    """``fpv2/...py:line function`` of the fpv2 frames of ``stack``, innermost first (``skip`` file excluded)."""
    sites = []
    for frame in reversed(stack):
        path = frame.filename.replace(os.sep, "/")
        at = path.rfind("/fpv2/")
        if at < 0 or path == skip:
            continue
        sites.append(f"{path[at + 1 :]}:{frame.lineno} {frame.name}")
    return sites


class SyncCounter:
    """Counts host synchronisations through PyTorch's sync debug mode (see the module docstring for its limits).

    Use as a context manager around the run, and :meth:`reset` / :meth:`take` around
    each measured window. Each sync is attributed to its innermost ``fpv2`` frames
    (up to three, innermost first), or to the innermost frame when no fpv2 code is on the stack.

    Args:
        active: count (None: only when CUDA is available). On a machine without CUDA an
            active counter sets no debug mode and only sees warnings raised by hand (tests).
    """

    def __init__(self, active: bool | None = None) -> None:
        self.active = torch.cuda.is_available() if active is None else bool(active)
        self._count = 0
        self._sites: Counter[str] = Counter()
        self._context: warnings.catch_warnings | None = None
        self._previous_mode: int | None = None
        self._previous_show: Callable[..., None] | None = None
        self._skip = str(Path(__file__).resolve()).replace(os.sep, "/")

    def __enter__(self) -> SyncCounter:
        if not self.active:
            return self
        self._context = warnings.catch_warnings()
        self._context.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}.*")
        self._previous_show = warnings.showwarning
        warnings.showwarning = self._show
        if torch.cuda.is_available():
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.active or self._context is None:
            return
        if self._previous_mode is not None:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self._context.__exit__(None, None, None)  # restores filters and showwarning
        self._context = None

    def _show(self, message: object, category: type, filename: str, lineno: int, *rest: object) -> None:
        if SYNC_WARNING not in str(message):
            assert self._previous_show is not None
            self._previous_show(message, category, filename, lineno, *rest)
            return
        self._count += 1
        stack = traceback.extract_stack()[:-1]
        frames = _fpv2_frames(stack, self._skip)
        if frames:
            site = " <- ".join(frames[:3])
        else:
            site = f"{filename}:{lineno}"
        self._sites[site] += 1

    def reset(self) -> None:
        """Forget what was counted so far (e.g. the harness's own syncs before a call)."""
        self._count = 0
        self._sites = Counter()

    def take(self) -> tuple[int | None, Counter[str]]:
        """Syncs counted since the last :meth:`reset` or :meth:`take`, and where, then reset.

        Returns:
            ``(count, sites)``; count is None for an inactive counter.
        """
        count, sites = self._count, self._sites
        self.reset()
        return (count if self.active else None), sites


class WorkspaceProbe:
    """Records the bytes held by every :class:`IndexWorkspace` reserved while active.

    Wraps ``IndexWorkspace.reserve`` (the class attribute) for the duration of the
    ``with`` block; each :meth:`take` returns the largest ``nbytes`` and the
    ``(num_programs, max_blocks, num_segments)`` of the reserves since the last take.
    """

    def __init__(self) -> None:
        self._bytes: int | None = None
        self._shape: tuple[int, int, int] | None = None
        self._original: Callable[..., object] | None = None

    def __enter__(self) -> WorkspaceProbe:
        original = IndexWorkspace.reserve
        probe = self

        def reserve(workspace: IndexWorkspace, *args: object, **kwargs: object) -> object:
            views = original(workspace, *args, **kwargs)
            nbytes = workspace.nbytes
            if probe._bytes is None or nbytes > probe._bytes:
                probe._bytes = nbytes
                probe._shape = (int(kwargs["num_programs"]), int(kwargs["max_blocks"]), int(kwargs["num_segments"]))
            return views

        self._original = original
        IndexWorkspace.reserve = reserve  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._original is not None:
            IndexWorkspace.reserve = self._original  # type: ignore[method-assign]
            self._original = None

    def take(self) -> tuple[int | None, tuple[int, int, int] | None]:
        """Largest workspace bytes and its reserve shape since the last take (None: no reserve).

        Returns:
            ``(nbytes, (num_programs, max_blocks, num_segments))`` or ``(None, None)``.
        """
        out = (self._bytes, self._shape)
        self._bytes, self._shape = None, None
        return out


def workspace_formula(
    q_lens: list[int] | tuple[int, ...],
    kv_lens: list[int] | tuple[int, ...],
    *,
    kv_heads: int,
    group: int,
    config: SelectionConfig,
    device: torch.device,
    scoring_on_hopper: bool = False,
) -> tuple[int, tuple[int, int, int]]:
    """Index workspace of one call by the documented formula, from host lengths alone.

    ``S = Hkv * sum(tiles)``, ``Nb = max blocks``, ``P = min(S, programs cap)`` for the fused Triton pass
    (a row of energies per program) and ``P = 1`` for the Hopper scoring kernel (its energies stay in shared
    memory), bytes ``= IndexWorkspace.required_bytes(P, Nb, S) = 4 (P Nb + S ceil(Nb/64) 2 + S)``.

    Args:
        q_lens: new queries per request of the batch the index ran on.
        kv_lens: KV lengths of that batch.
        kv_heads: ``Hkv``.
        group: ``Hq / Hkv``.
        config: selection parameters (tile and block sizes).
        device: where the index runs (sets the programs cap).
        scoring_on_hopper: the call's scoring ran on the Hopper kernel
            (:func:`fpv2.index.triton.hopper_scoring.use_hopper_scoring`).

    Returns:
        ``(bytes, (P, Nb, S))``.
    """
    segments = kv_heads * sum(num_query_tiles(n, group, config.tile_size) for n in q_lens)
    max_blocks = max((num_key_blocks(k, config.block_size) for k in kv_lens), default=0)
    programs = 1 if scoring_on_hopper else IndexWorkspace().num_programs(segments, device)
    return IndexWorkspace.required_bytes(programs, max_blocks, segments), (programs, max_blocks, segments)


def workspace_bound(cfg: SoakConfig, device: torch.device) -> tuple[int, tuple[int, int, int]]:
    """The formula at the largest composition of ``cfg``: no call of the soak can need more.

    Args:
        cfg: the soak configuration.
        device: where the index runs.

    Returns:
        ``(bytes, (P, Nb, S))``.
    """
    lens = [cfg.max_len] * cfg.max_batch
    return workspace_formula(
        lens,
        lens,
        kv_heads=cfg.kv_heads,
        group=cfg.q_heads // cfg.kv_heads,
        config=cfg.selection(),
        device=device,
    )


# ---------------------------------------------------------------------------- records
@dataclass
class CallRecord:
    """What one soak call measured.

    Attributes:
        index: call number.
        page_size: its page size.
        batch_size: its requests.
        total_q: its query rows.
        max_kv: its longest KV length.
        prefixes: requests with a cached prefix.
        empties: requests without queries.
        host_ms: host wall time of the call (on CUDA the launch overhead, not the GPU time).
        allocated: CUDA bytes allocated after the call (outputs dropped), or None.
        reserved: CUDA bytes reserved after the call, or None.
        peak_allocated: CUDA peak allocated during the call, or None.
        rss: process RSS after the call (None where unavailable); judged on the CPU, reported on CUDA.
        workspace_bytes: bytes held by the index workspace(s) of the call (None: no Triton index ran).
        workspace_expected: the formula's bytes for the batch the index ran on (None: no Triton index).
        workspace_shape: the ``(P, Nb, S)`` the index reserved.
        expected_shape: the ``(P, Nb, S)`` of the formula.
        syncs: host syncs inside the call (None: not counted).
    """

    index: int
    page_size: int
    batch_size: int
    total_q: int
    max_kv: int
    prefixes: int
    empties: int
    host_ms: float
    allocated: int | None = None
    reserved: int | None = None
    peak_allocated: int | None = None
    rss: int | None = None
    workspace_bytes: int | None = None
    workspace_expected: int | None = None
    workspace_shape: tuple[int, int, int] | None = None
    expected_shape: tuple[int, int, int] | None = None
    syncs: int | None = None


class SoakCall(NamedTuple):
    """One call as :func:`run_soak` hands it to its ``on_call`` hook.

    Attributes:
        index: call number.
        composition: the call's batch shape.
        q: its queries.
        k_cache: the paged keys (a view of the shared buffer for this page size).
        v_cache: the paged values.
        batch: its batch metadata.
        result: what the pipeline returned.
    """

    index: int
    composition: Composition
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    batch: PagedPrefillBatch
    result: object


@dataclass
class SoakResult:
    """A soak run: its records, the sync sites and the summary (see :func:`summarise`).

    Attributes:
        config: the configuration.
        device: where it ran.
        backend: the attention backend name.
        records: one :class:`CallRecord` per completed call.
        sync_sites: sync sites over the steady window, with their counts.
        summary: the verdicts.
        error: the exception text when a call failed, else None.
        stopped_early: the time limit ended the run before ``config.calls`` calls.
    """

    config: SoakConfig
    device: str
    backend: str
    records: list[CallRecord]
    sync_sites: dict[str, int] = field(default_factory=dict)
    summary: dict[str, object] = field(default_factory=dict)
    error: str | None = None
    stopped_early: bool = False

    def to_dict(self) -> dict[str, object]:
        """The JSON document of the run (per-call values as columns).

        Returns:
            ``{"schema", "config", "device", "backend", "summary", "sync_sites", "error", "calls": {...}}``.
        """
        columns = {f.name: [getattr(r, f.name) for r in self.records] for f in dataclasses.fields(CallRecord)}
        return {
            "schema": SOAK_SCHEMA,
            "config": dataclasses.asdict(self.config),
            "device": self.device,
            "backend": self.backend,
            "summary": self.summary,
            "sync_sites": self.sync_sites,
            "error": self.error,
            "stopped_early": self.stopped_early,
            "calls": columns,
        }


class SoakError(RuntimeError):
    """A soak call raised; :attr:`result` holds the calls before it and the summary so far.

    Args:
        message: what failed, with the call's composition.
        result: the partial result.
    """

    def __init__(self, message: str, result: SoakResult) -> None:
        super().__init__(message)
        self.result = result


# ------------------------------------------------------------------------------- run
class _Workload:
    """One KV buffer viewed with every page size, and a pool of query rows."""

    def __init__(self, cfg: SoakConfig, device: torch.device) -> None:
        granule = math.lcm(*cfg.page_sizes)
        per_request = -(-cfg.max_len // granule) * granule
        self.tokens = cfg.max_batch * per_request
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        dtype = DTYPES[cfg.dtype]
        shape = (self.tokens, cfg.kv_heads, cfg.head_dim)
        self.k = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        self.v = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
        rows = cfg.max_batch * cfg.max_len
        self.q = torch.randn((rows, cfg.q_heads, cfg.head_dim), generator=gen, device=device, dtype=torch.float32)
        self.q = self.q.to(dtype)
        self.device = device
        self.seed_host_view = cfg.seed_host_view
        self.page_gen = torch.Generator().manual_seed(cfg.seed + 1)

    def caches(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV buffer as ``(num_pages, page_size, Hkv, d)`` views."""
        pages = self.tokens // page_size
        return (
            self.k.view(pages, page_size, *self.k.shape[1:]),
            self.v.view(pages, page_size, *self.v.shape[1:]),
        )

    def batch(self, comp: Composition) -> tuple[torch.Tensor, PagedPrefillBatch]:
        """Queries and batch metadata of one call; pages drawn at random from the whole cache."""
        num_pages = self.tokens // comp.page_size
        needed = [-(-k // comp.page_size) for k in comp.kv_lens]
        order = torch.randperm(num_pages, generator=self.page_gen)
        table = torch.full((len(needed), max(max(needed), 1)), -1, dtype=torch.int32)
        start = 0
        for b, n in enumerate(needed):
            table[b, :n] = order[start : start + n]
            start += n
        cu = [0]
        for n in comp.q_lens:
            cu.append(cu[-1] + n)
        # The harness plays the engine: its metadata is already on the device, its host lengths known.
        batch = PagedPrefillBatch(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32).to(self.device, non_blocking=True),
            seqlens_k=torch.tensor(comp.kv_lens, dtype=torch.int32).to(self.device, non_blocking=True),
            page_table=table.to(self.device, non_blocking=True),
            page_size=comp.page_size,
            num_pages=num_pages,
            check_values=False,
        )
        if self.seed_host_view:
            batch.assume_host_view(HostBatchView(cu_seqlens_q=cu, seqlens_k=list(comp.kv_lens)))
        return self.q[: cu[-1]], batch


def build_pipeline(cfg: SoakConfig) -> tuple[PipelineFn, str]:
    """The pipeline a soak calls, and its backend's name.

    Args:
        cfg: the soak configuration.

    Returns:
        ``(callable(q, k_cache, v_cache, batch) -> result, backend name)``.
    """
    if cfg.routed:
        from .routing import RoutedPrefillPipeline

        routed = RoutedPrefillPipeline(
            cfg.selection(),
            table=cfg.routing_table,
            strategy=cfg.strategy,
            correction=cfg.correction,
            backend=cfg.backend,
        )
        return routed, routed.backend.name
    from .pipeline import SparsePrefillPipeline

    plain = SparsePrefillPipeline(
        cfg.selection(), strategy=cfg.strategy, correction=cfg.correction, backend=cfg.backend
    )
    return plain, plain.backend.name


def _scored_on_hopper(q: torch.Tensor, config: SelectionConfig, batch: PagedPrefillBatch) -> bool:
    """Whether the index's scoring ran on the Hopper kernel for ``batch``: the index's own rule, same arguments."""
    from fpv2.index.triton.hopper_scoring import use_hopper_scoring

    max_blocks = max((num_key_blocks(k, config.block_size) for k in batch.host.seqlens_k), default=0)
    return use_hopper_scoring(q, config, q.shape[2], max_blocks, False)


def _index_batch(result: object, batch: PagedPrefillBatch) -> PagedPrefillBatch | None:
    """The batch the sparse index ran on: the whole batch, a routed result's sparse sub-batch, or None."""
    if hasattr(result, "sparse_batch"):
        return result.sparse_batch  # type: ignore[no-any-return]
    return batch


def _one_call(
    cfg: SoakConfig,
    workload: _Workload,
    pipeline: PipelineFn,
    comp: Composition,
    index: int,
    counter: SyncCounter,
    probe: WorkspaceProbe,
    on_call: Callable[[SoakCall], None] | None,
) -> tuple[CallRecord, Counter[str]]:
    """Run one call; every tensor it made is dropped when it returns. Returns its record and sync sites."""
    device = workload.device
    q, batch = workload.batch(comp)
    k_cache, v_cache = workload.caches(comp.page_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    probe.take()
    counter.reset()
    t0 = time.perf_counter()
    result = pipeline(q, k_cache, v_cache, batch)
    host_ms = (time.perf_counter() - t0) * 1e3
    syncs, sites = counter.take()
    ws_bytes, ws_shape = probe.take()
    record = CallRecord(
        index=index,
        page_size=comp.page_size,
        batch_size=len(comp.q_lens),
        total_q=sum(comp.q_lens),
        max_kv=max(comp.kv_lens),
        prefixes=comp.prefixes,
        empties=comp.empties,
        host_ms=host_ms,
        workspace_bytes=ws_bytes,
        workspace_shape=ws_shape,
        syncs=syncs,
    )
    if ws_bytes is not None:
        ran_on = _index_batch(result, batch)
        if ran_on is not None:
            config = cfg.selection()
            expected, shape = workspace_formula(
                ran_on.host.q_lens,
                ran_on.host.seqlens_k,
                kv_heads=cfg.kv_heads,
                group=cfg.q_heads // cfg.kv_heads,
                config=config,
                device=device,
                scoring_on_hopper=_scored_on_hopper(q, config, ran_on),
            )
            record.workspace_expected, record.expected_shape = expected, shape
    out = result.out  # type: ignore[attr-defined]
    if out.shape != q.shape or out.dtype != output_dtype(q.dtype):
        raise RuntimeError(
            f"pipeline output has shape {tuple(out.shape)} and dtype {out.dtype}; expected {tuple(q.shape)} "
            f"{output_dtype(q.dtype)}"
        )
    if cfg.check_every and index % cfg.check_every == 0 and not bool(torch.isfinite(out).all()):
        raise RuntimeError("pipeline output holds non-finite values")
    if on_call is not None:
        on_call(SoakCall(index, comp, q, k_cache, v_cache, batch, result))
    return record, sites


def run_soak(
    cfg: SoakConfig,
    *,
    device: torch.device | str | None = None,
    pipeline: PipelineFn | None = None,
    on_call: Callable[[SoakCall], None] | None = None,
    progress: Callable[[int, CallRecord], None] | None = None,
) -> SoakResult:
    """Run the soak and summarise it.

    Args:
        cfg: what to run.
        device: where (None: CUDA when available, else the CPU).
        pipeline: the callable to soak (None: :func:`build_pipeline`); it must return an
            object with ``out`` (``(total_q, Hq, d)``).
        on_call: called with a :class:`SoakCall` after each call (extra checks; runs outside the
            counted window, and what it keeps alive counts as memory growth).
        progress: called with ``(call index, record)`` after each call.

    Returns:
        The :class:`SoakResult` with its summary.

    Raises:
        SoakError: a call raised; the message names the call and its composition, ``result``
            holds the partial run.
    """
    device = (
        torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend_name = getattr(getattr(pipeline, "backend", None), "name", "custom")
    if pipeline is None:
        pipeline, backend_name = build_pipeline(cfg)
    workload = _Workload(cfg, device)
    result = SoakResult(cfg, str(device), backend_name, [])
    # The strategy's index workspaces outlive calls (and earlier runs in this process): start them fresh,
    # so the bytes held measure this soak's compositions only.
    release = getattr(get_strategy(cfg.strategy), "release_workspaces", None)
    if callable(release):
        release()
    steady_sites: Counter[str] = Counter()
    counter = SyncCounter(active=cfg.count_syncs and device.type == "cuda")
    began = time.perf_counter()
    with counter, WorkspaceProbe() as probe:
        for i, comp in enumerate(draw_compositions(cfg)):
            if cfg.time_limit_s is not None and time.perf_counter() - began > cfg.time_limit_s:
                result.stopped_early = True
                break
            try:
                record, sites = _one_call(cfg, workload, pipeline, comp, i, counter, probe, on_call)
            except Exception as exc:
                result.error = f"call {i} ({comp}): {type(exc).__name__}: {exc}"
                result.sync_sites = dict(steady_sites)
                result.summary = summarise(result.records, cfg, device)
                raise SoakError(result.error, result) from exc
            if i >= cfg.steady_start:
                steady_sites.update(sites)
            if device.type == "cuda":
                record.allocated = torch.cuda.memory_allocated(device)
                record.reserved = torch.cuda.memory_reserved(device)
                record.peak_allocated = torch.cuda.max_memory_allocated(device)
            record.rss = current_rss_bytes()  # host memory too: caches that grow per shape show up here
            result.records.append(record)
            if progress is not None:
                progress(i, record)
    result.sync_sites = dict(steady_sites.most_common())
    result.summary = summarise(result.records, cfg, device, steady_sites=steady_sites)
    result.summary["calls_planned"] = cfg.calls
    result.summary["stopped_at_time_limit"] = result.stopped_early
    result.summary["wall_s"] = time.perf_counter() - began
    return result


# --------------------------------------------------------------------------- summary
def _median(values: list[int]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _growth(values: list[int], bound: int) -> dict[str, object]:
    """Growth of one memory series over its window, and whether it stays within ``bound``.

    Growth is the median of the window's last quarter minus the median of its first
    quarter: a leak raises the level for good, a transient peak (an allocator or malloc
    arena briefly holding more) does not count. The peak above the first value and the
    least-squares slope are reported next to it.
    """
    n = len(values)
    quarter = max(1, n // 4)
    growth = _median(values[-quarter:]) - _median(values[:quarter])
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    var = sum((i - mean_x) ** 2 for i in range(n))
    slope = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / var if var else 0.0
    return {
        "first": values[0],
        "min": min(values),
        "max": max(values),
        "last": values[-1],
        "growth_bytes": growth,
        "peak_over_first_bytes": max(values) - values[0],
        "slope_bytes_per_call": slope,
        "bound_bytes": bound,
        "flat": growth <= bound,
    }


def summarise(
    records: list[CallRecord],
    cfg: SoakConfig,
    device: torch.device,
    *,
    steady_sites: Counter[str] | None = None,
) -> dict[str, object]:
    """The verdicts of a soak over its steady window (the last ``cfg.steady_fraction`` of the calls).

    Memory is flat when its level (median of the window's last quarter against its first
    quarter) grows by at most its bound; the workspace is bounded when every call reserves the formula's shape
    for its lengths, holds at least the formula's bytes for it (a reused workspace keeps the largest call's
    capacity) and none holds more than the formula at the largest composition; syncs are judged
    against ``cfg.max_syncs_per_call``.

    Args:
        records: the completed calls.
        cfg: the configuration.
        device: where it ran.
        steady_sites: sync sites over the window (for the per-call breakdown).

    Returns:
        A JSON-ready dict with ``memory``, ``workspace``, ``syncs``, ``host_ms``, ``compositions`` and ``ok``.
    """
    start = cfg.steady_start
    steady = [r for r in records if r.index >= start]
    summary: dict[str, object] = {
        "calls": len(records),
        "steady_from_call": start,
        "steady_calls": len(steady),
        "compositions": {
            "page_sizes": dict(Counter(r.page_size for r in records)),
            "max_batch": max((r.batch_size for r in records), default=0),
            "max_kv": max((r.max_kv for r in records), default=0),
            "requests_with_prefix": sum(r.prefixes for r in records),
            "zero_length_requests": sum(r.empties for r in records),
        },
    }
    checks: list[bool] = []
    memory: dict[str, object] = {}
    if steady and device.type == "cuda":
        memory["cuda_allocated"] = _growth([r.allocated or 0 for r in steady], cfg.allocated_growth_bound)
        memory["cuda_reserved"] = _growth([r.reserved or 0 for r in steady], cfg.reserved_growth_bound)
        memory["cuda_peak_allocated_max"] = max(r.peak_allocated or 0 for r in records)
        checks += [bool(memory["cuda_allocated"]["flat"]), bool(memory["cuda_reserved"]["flat"])]  # type: ignore[index]
    if steady and all(r.rss is not None for r in steady):
        rss = _growth([r.rss or 0 for r in steady], cfg.rss_growth_bound)
        if device.type == "cuda":
            # The CUDA driver and pinned buffers live in the RSS too: reported, not judged, on a GPU.
            rss["informative"] = True
        else:
            checks.append(bool(rss["flat"]))
        memory["rss"] = rss
    summary["memory"] = memory

    bound, bound_shape = workspace_bound(cfg, device)
    measured = [r for r in records if r.workspace_bytes is not None]
    # A reused workspace holds the capacity of the largest call so far: per call, the reserve must ask
    # for exactly the formula's shape, and what is held must cover the formula's bytes.
    mismatches = [
        r
        for r in measured
        if r.workspace_expected is not None
        and (
            tuple(r.workspace_shape or ()) != tuple(r.expected_shape or ())
            or (r.workspace_bytes or 0) < r.workspace_expected
        )
    ]
    largest = max((r.workspace_bytes or 0 for r in measured), default=None)
    workspace: dict[str, object] = {
        "measured_calls": len(measured),
        "max_bytes": largest,
        "bound_bytes": bound,
        "bound_shape_P_Nb_S": list(bound_shape),
        "formula": "4 * (P * Nb + S * ceil(Nb / 64) * 2 + S), P = min(S, programs cap), S = Hkv * tiles",
        "rule": "per call the reserve asks for the formula's (P, Nb, S) and the bytes held (a workspace reused "
        "across calls keeps the capacity of the largest) cover the formula's bytes; no call holds more than the "
        "formula at the largest composition",
        "held_equals_call_formula": sum(1 for r in measured if r.workspace_bytes == r.workspace_expected),
        "formula_mismatches": len(mismatches),
        "first_mismatch": dataclasses.asdict(mismatches[0]) if mismatches else None,
        "within_bound": largest is None or largest <= bound,
    }
    if not measured:
        workspace["note"] = "no Triton index ran (CPU or reference index): nothing to measure"
    checks += [bool(workspace["within_bound"]), not mismatches]
    summary["workspace"] = workspace

    counts = [r.syncs for r in steady if r.syncs is not None]
    if counts:
        ordered = sorted(counts)
        syncs: dict[str, object] = {
            "method": "torch.cuda.set_sync_debug_mode('warn'), warnings counted and attributed to fpv2 frames",
            "limits": "lower bound: misses Event.synchronize, Triton/driver-internal syncs, allocator cudaMalloc/Free, "
            "native (non-PyTorch) code",
            "per_call_median": ordered[len(ordered) // 2],
            "per_call_min": ordered[0],
            "per_call_max": ordered[-1],
            "per_call_histogram": dict(sorted(Counter(counts).items())),
            "steady_total": sum(counts),
            "host_view_seeded": cfg.seed_host_view,
            "limit_per_call": cfg.max_syncs_per_call,
            "zero_on_fast_path": ordered[-1] == 0,
            "sites_per_call": {site: n / len(counts) for site, n in (steady_sites or Counter()).most_common()},
        }
        if cfg.max_syncs_per_call is not None:
            checks.append(ordered[-1] <= cfg.max_syncs_per_call)
    else:
        syncs = {"method": "not counted (CPU run, or count_syncs=False)"}
    summary["syncs"] = syncs

    host = sorted(r.host_ms for r in steady)
    if host:
        summary["host_ms"] = {"median": host[len(host) // 2], "p99": host[min(len(host) - 1, int(0.99 * len(host)))]}
    summary["ok"] = all(checks)
    return summary


# ---------------------------------------------------------------------------- output
def write_soak_plot(path: Path, result: SoakResult) -> Path:
    """PNG of memory, workspace and syncs per call (the steady window shaded).

    Args:
        path: output file.
        result: the soak run.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = result.records
    calls = [r.index for r in records]
    fig = Figure(figsize=(9.0, 8.0), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True)
    mib = 1 / 2**20
    if records and records[0].allocated is not None:
        axes[0].plot(calls, [(r.allocated or 0) * mib for r in records], label="allocated after call")
        axes[0].plot(calls, [(r.reserved or 0) * mib for r in records], label="reserved")
        axes[0].plot(calls, [(r.peak_allocated or 0) * mib for r in records], lw=0.5, alpha=0.5, label="peak in call")
    else:
        axes[0].plot(calls, [(r.rss or 0) * mib for r in records], label="process RSS after call")
    axes[0].set_ylabel("MiB")
    axes[0].legend(fontsize=7)
    ws = [(r.index, (r.workspace_bytes or 0) * mib) for r in records if r.workspace_bytes is not None]
    if ws:
        axes[1].plot([i for i, _ in ws], [b for _, b in ws], ".", ms=2, label="index workspace")
    else:
        axes[1].text(0.5, 0.5, "no Triton index ran", ha="center", va="center", transform=axes[1].transAxes)
    bound = result.summary.get("workspace", {}).get("bound_bytes")  # type: ignore[union-attr]
    if bound:
        axes[1].axhline(bound * mib, color="red", ls="--", lw=1, label="formula at the largest composition")
    axes[1].set_ylabel("workspace MiB")
    axes[1].legend(fontsize=7)
    syncs = [(r.index, r.syncs) for r in records if r.syncs is not None]
    if syncs:
        axes[2].plot([i for i, _ in syncs], [s for _, s in syncs], ".", ms=2)
    else:
        axes[2].text(0.5, 0.5, "syncs not counted (CPU run)", ha="center", va="center", transform=axes[2].transAxes)
    axes[2].set_ylabel("host syncs / call")
    axes[2].set_xlabel("call")
    start = result.config.steady_start
    for ax in axes:
        ax.axvspan(start, max(calls[-1] if calls else start, start), color="#eeeeee", zorder=0)
        ax.grid(True, alpha=0.3)
    cfg = result.config
    fig.suptitle(
        f"fpv2 soak: {len(records)} calls on {result.device} ({result.backend}), B<={cfg.max_batch}, "
        f"L<={cfg.max_len}, pages {list(cfg.page_sizes)}; steady window shaded",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
