"""Density routing: short requests take the dense path, long ones the sparse pipeline, by measured cost.

Below some KV length the sparse pipeline loses to plain dense attention: the
index stage costs about as much as it saves, and the density of short prompts
is high anyway (the published implementation is at parity with dense at 4K).
Where that switch point lies depends on the GPU, the kernels, the head shapes
and ``alpha``, so it is *measured* (``benchmarks/routing_switch_point.py``)
and stored in a :class:`RoutingTable`:

- a :class:`RoutingKey` is one configuration: ``(Hq, Hkv, d, dtype, page size, alpha)``;
- its :class:`RoutingCurve` holds measured points ``kv_len -> (sparse pipeline ms,
  dense ms)``. Between points the log of the time ratio ``sparse / dense`` is
  interpolated linearly in ``log(kv_len)`` (times follow power laws in the
  length); outside the measured range the nearest point's ratio holds;
- the JSON file (schema :data:`ROUTING_SCHEMA`) is what the measurement script
  writes and :meth:`RoutingTable.load` reads.

:class:`DensityRouter` decides per request from its KV length (``seqlens_k``,
cached prefix included: the quantity both costs and the density grow with).
By default it uses the table measured on the current GPU model and shipped in
:mod:`.routing_measured` (today: the H200, Hq=32/Hkv=8/d=128 bf16, page size 1,
``alpha = 0.1``: sparse from about 10K KV tokens on). Without a table, or
without a curve for the inputs' key, it falls back to the
documented conservative rule :func:`default_prefers_sparse`: sparse only from
``SelectionConfig.min_sparse_kv_len`` on, where the sparse pipeline would stop
keeping everything anyway, so it is never routed to sparse below that length.
With a table the measured curve replaces ``min_sparse_kv_len``: the sparse
path then runs with ``min_sparse_kv_len = 0`` (the router already made that
decision), optionally under a hard ``floor_kv_len``.

:func:`split_batch` cuts a varlen batch into a sub-batch of chosen requests
(rows of ``cu_seqlens_q``/``seqlens_k``/``page_table`` and the matching query
rows, over the same KV cache) and :func:`merge_outputs` puts the sub-batch
outputs back in the parent's row order. :class:`RoutedPrefillPipeline`
composes them with :class:`~.pipeline.SparsePrefillPipeline` and a dense path:
the backend's kernel dense mode when it offers one (``run_dense``, or the
Triton kernel with no index), else the same backend with the ``dense``
strategy and no correction.

Host work: the router reads ``batch.host`` (cached on the batch; engines seed
it with :meth:`~fpv2.kernel.PagedPrefillBatch.assume_host_view`); a split
copies one small int32 vector to the device without blocking and gathers on
the device, so splitting adds no host synchronisation.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fpv2.index import SelectionConfig
from fpv2.kernel import PagedPrefillBatch, validate_prefill_inputs
from fpv2.kernel.contracts import HostBatchView

from .backends import AUTO, AttentionBackend, output_dtype
from .pipeline import DENSE_STRATEGY, PrefillResult, SparsePrefillPipeline
from .transfer import device_ints

#: Schema tag of routing table files.
ROUTING_SCHEMA = "fpv2-routing/1"
#: Names of the element types in routing keys (the ``--dtype`` names of ``fpv2 bench``).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8",
}
#: Digits ``alpha`` is rounded to in keys, so that 0.1 read from JSON matches 0.1 in a config.
ALPHA_DIGITS = 6
#: ``dense_mode`` values of :class:`RoutedPrefillPipeline`.
DENSE_MODES = ("auto", "kernel", "strategy")

DenseRunner = Callable[..., torch.Tensor]


class _Measured:
    """Type of :data:`MEASURED`."""

    def __repr__(self) -> str:
        return "MEASURED"


#: ``table`` value (the default) asking for the routing table shipped for the current GPU
#: (:func:`fpv2.serving.routing_measured.measured_table`); none there means the default rule.
MEASURED = _Measured()


# ---------------------------------------------------------------------------- the table
def _int_field(where: str, name: str, value: object, minimum: int) -> int:
    """An int (not a bool) of at least ``minimum``; TypeError/ValueError naming ``where.name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}.{name} must be >= {minimum}, got {value}")
    return value


def _ms_field(where: str, name: str, value: object) -> float:
    """A positive finite time in milliseconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}.{name} must be a number of milliseconds, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}.{name} must be positive and finite, got {value}")
    return float(value)


@dataclass(frozen=True)
class RoutingKey:
    """The configuration one routing curve was measured for.

    Attributes:
        q_heads: ``Hq``.
        kv_heads: ``Hkv``.
        head_dim: ``d``.
        dtype: element type name, one of ``bf16``, ``fp16``, ``fp32``, ``fp8``.
        page_size: tokens per KV cache page.
        alpha: max-threshold ratio of the selection (rounded to :data:`ALPHA_DIGITS` digits).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range or ``dtype`` is unknown.
    """

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    alpha: float

    def __post_init__(self) -> None:
        for name in ("q_heads", "kv_heads", "head_dim", "page_size"):
            _int_field("RoutingKey", name, getattr(self, name), 1)
        if self.q_heads % self.kv_heads:
            raise ValueError(f"RoutingKey.q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}")
        if not isinstance(self.dtype, str):
            raise TypeError(f"RoutingKey.dtype must be a str, got {type(self.dtype).__name__} {self.dtype!r}")
        if self.dtype not in DTYPE_NAMES.values():
            raise ValueError(f"RoutingKey.dtype must be one of {sorted(DTYPE_NAMES.values())}, got {self.dtype!r}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"RoutingKey.alpha must be a float, got {type(alpha).__name__} {alpha!r}")
        if not (0.0 < alpha <= 1.0):
            raise ValueError(f"RoutingKey.alpha must lie in (0, 1], got {alpha}")
        object.__setattr__(self, "alpha", round(float(alpha), ALPHA_DIGITS))

    @classmethod
    def from_inputs(
        cls, q: torch.Tensor, k_cache: torch.Tensor, batch: PagedPrefillBatch, config: SelectionConfig
    ) -> RoutingKey:
        """The key of one prefill call.

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
            batch: the batch (its page size).
            config: the selection parameters (their ``alpha``).

        Returns:
            The key.

        Raises:
            ValueError: ``q`` has an element type without a key name.
        """
        if q.dtype not in DTYPE_NAMES:
            raise ValueError(f"no routing key for q of dtype {q.dtype}; known: {sorted(map(str, DTYPE_NAMES))}")
        return cls(
            q_heads=q.shape[1],
            kv_heads=k_cache.shape[2],
            head_dim=q.shape[2],
            dtype=DTYPE_NAMES[q.dtype],
            page_size=batch.page_size,
            alpha=config.alpha,
        )

    @classmethod
    def from_dict(cls, data: object, *, where: str = "key") -> RoutingKey:
        """Parse a key from its JSON object.

        Args:
            data: ``{"q_heads", "kv_heads", "head_dim", "dtype", "page_size", "alpha"}``.
            where: location named in error messages.

        Returns:
            The key.

        Raises:
            TypeError: ``data`` is not an object, or a field has the wrong type.
            ValueError: a field is missing or out of range.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"{where} must be a JSON object, got {type(data).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        missing = [name for name in fields if name not in data]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)} (a key needs {', '.join(fields)})")
        return cls(**{name: data[name] for name in fields})

    def to_dict(self) -> dict[str, object]:
        """The JSON object of this key.

        Returns:
            A dict of the six fields.
        """
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (
            f"Hq={self.q_heads} Hkv={self.kv_heads} d={self.head_dim} {self.dtype} page_size={self.page_size} "
            f"alpha={self.alpha:g}"
        )


@dataclass(frozen=True)
class RoutingPoint:
    """One measured KV length: the whole sparse pipeline's time and the dense path's time.

    Attributes:
        kv_len: KV length of the measurement (B=1, no prefix).
        sparse_ms: median time of the sparse pipeline (index, correction plan and attention).
        dense_ms: median time of the dense path the router would take.
        density: the sparse index's measured density, if recorded.

    Raises:
        TypeError, ValueError: a field is not a positive int / positive finite time.
    """

    kv_len: int
    sparse_ms: float
    dense_ms: float
    density: float | None = None

    def __post_init__(self) -> None:
        _int_field("RoutingPoint", "kv_len", self.kv_len, 1)
        object.__setattr__(self, "sparse_ms", _ms_field("RoutingPoint", "sparse_ms", self.sparse_ms))
        object.__setattr__(self, "dense_ms", _ms_field("RoutingPoint", "dense_ms", self.dense_ms))
        if self.density is not None:
            if isinstance(self.density, bool) or not isinstance(self.density, (int, float)):
                raise TypeError(f"RoutingPoint.density must be a float or None, got {type(self.density).__name__}")
            if not (0.0 <= self.density <= 1.0):
                raise ValueError(f"RoutingPoint.density must lie in [0, 1], got {self.density}")

    @property
    def log_ratio(self) -> float:
        """``log(sparse_ms / dense_ms)``: negative where the sparse pipeline is faster."""
        return math.log(self.sparse_ms / self.dense_ms)

    def to_dict(self) -> dict[str, object]:
        """The JSON object of this point.

        Returns:
            ``{"kv_len", "sparse_ms", "dense_ms", "density"}``.
        """
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RoutingCurve:
    """Measured sparse and dense times of one :class:`RoutingKey` over KV lengths.

    Args:
        key: the configuration.
        points: the measurements, any order, distinct ``kv_len`` values (stored ascending).
        meta: provenance kept with the curve (GPU, backend, dense path, commit, ...).

    Raises:
        TypeError: ``key`` or a point has the wrong type.
        ValueError: no points, or two points at the same ``kv_len``.
    """

    key: RoutingKey
    points: tuple[RoutingPoint, ...]
    meta: Mapping[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, RoutingKey):
            raise TypeError(f"RoutingCurve.key must be a RoutingKey, got {type(self.key).__name__}")
        points = tuple(self.points)
        for p in points:
            if not isinstance(p, RoutingPoint):
                raise TypeError(f"RoutingCurve.points must hold RoutingPoint objects, got {type(p).__name__}")
        if not points:
            raise ValueError(f"routing curve for {self.key} has no points")
        points = tuple(sorted(points, key=lambda p: p.kv_len))
        lengths = [p.kv_len for p in points]
        if len(set(lengths)) != len(lengths):
            raise ValueError(f"routing curve for {self.key} measures some kv_len twice: {lengths}")
        object.__setattr__(self, "points", points)
        object.__setattr__(self, "meta", dict(self.meta))

    def log_ratio(self, kv_len: int) -> float:
        """Interpolated ``log(sparse_ms / dense_ms)`` at ``kv_len``.

        Linear in ``log(kv_len)`` between measured points; outside the measured
        range, the nearest point's value.

        Args:
            kv_len: a KV length (>= 1; 0 is treated as 1).

        Returns:
            The log time ratio (negative: sparse is faster).
        """
        pts = self.points
        if kv_len <= pts[0].kv_len:
            return pts[0].log_ratio
        if kv_len >= pts[-1].kv_len:
            return pts[-1].log_ratio
        x = math.log(kv_len)
        for lo, hi in itertools.pairwise(pts):
            if kv_len <= hi.kv_len:
                x0, x1 = math.log(lo.kv_len), math.log(hi.kv_len)
                t = (x - x0) / (x1 - x0)
                return lo.log_ratio + t * (hi.log_ratio - lo.log_ratio)
        return pts[-1].log_ratio  # unreachable: kv_len < pts[-1].kv_len

    def prefers_sparse(self, kv_len: int, *, min_speedup: float = 1.0) -> bool:
        """Whether the sparse pipeline is expected to beat dense by more than ``min_speedup`` at ``kv_len``.

        Args:
            kv_len: the KV length.
            min_speedup: required ``dense_ms / sparse_ms`` (1: any gain; ties go dense).

        Returns:
            True for the sparse path.
        """
        return self.log_ratio(kv_len) < -math.log(min_speedup)

    def switch_kv_len(self, *, min_speedup: float = 1.0) -> float | None:
        """KV length from which on the sparse pipeline wins (through the largest measured length).

        The crossing of the interpolated ratio with ``1 / min_speedup`` below which
        (down to the previous crossing or the smallest point) dense wins. None when
        dense wins at the largest measured length, or sparse wins over the whole
        measured range (then it wins everywhere, by the nearest-point rule).

        Args:
            min_speedup: as for :meth:`prefers_sparse`.

        Returns:
            The (fractional) switch length, or None.
        """
        threshold = -math.log(min_speedup)
        pts = self.points
        if pts[-1].log_ratio >= threshold:
            return None
        for i in range(len(pts) - 1, 0, -1):
            lo, hi = pts[i - 1], pts[i]
            if lo.log_ratio >= threshold:  # dense at lo, sparse at hi: the crossing lies in between
                x0, x1 = math.log(lo.kv_len), math.log(hi.kv_len)
                t = (threshold - lo.log_ratio) / (hi.log_ratio - lo.log_ratio)
                return math.exp(x0 + t * (x1 - x0))
        return None

    def to_dict(self) -> dict[str, object]:
        """The JSON object of this curve.

        Returns:
            ``{"key", "points", "switch_kv_len", "meta"}`` (``switch_kv_len`` is informative).
        """
        return {
            "key": self.key.to_dict(),
            "points": [p.to_dict() for p in self.points],
            "switch_kv_len": self.switch_kv_len(),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: object, *, where: str = "curve") -> RoutingCurve:
        """Parse a curve from its JSON object.

        Args:
            data: ``{"key": {...}, "points": [{"kv_len", "sparse_ms", "dense_ms"[, "density"]}, ...]}``;
                other members (``switch_kv_len``, ``meta``) are optional.
            where: location named in error messages.

        Returns:
            The curve.

        Raises:
            TypeError, ValueError: a malformed curve, naming the offending member.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"{where} must be a JSON object, got {type(data).__name__}")
        for name in ("key", "points"):
            if name not in data:
                raise ValueError(f"{where} lacks {name!r}")
        key = RoutingKey.from_dict(data["key"], where=f"{where}.key")
        raw = data["points"]
        if not isinstance(raw, list):
            raise TypeError(f"{where}.points must be a list, got {type(raw).__name__}")
        points = []
        for i, item in enumerate(raw):
            at = f"{where}.points[{i}]"
            if not isinstance(item, Mapping):
                raise TypeError(f"{at} must be a JSON object, got {type(item).__name__}")
            for name in ("kv_len", "sparse_ms", "dense_ms"):
                if name not in item:
                    raise ValueError(f"{at} lacks {name!r}")
            try:
                points.append(RoutingPoint(item["kv_len"], item["sparse_ms"], item["dense_ms"], item.get("density")))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{at}: {exc}") from exc
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise TypeError(f"{where}.meta must be a JSON object, got {type(meta).__name__}")
        try:
            return cls(key, tuple(points), meta)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc


class RoutingTable:
    """Measured routing curves, one per :class:`RoutingKey`.

    Args:
        curves: the curves; their keys must be distinct.
        meta: provenance of the whole table (GPU, commit, date, ...).

    Raises:
        TypeError: an item is not a RoutingCurve.
        ValueError: two curves share a key.
    """

    def __init__(self, curves: Iterable[RoutingCurve], *, meta: Mapping[str, object] | None = None) -> None:
        self._curves: dict[RoutingKey, RoutingCurve] = {}
        for curve in curves:
            if not isinstance(curve, RoutingCurve):
                raise TypeError(f"RoutingTable holds RoutingCurve objects, got {type(curve).__name__}")
            if curve.key in self._curves:
                raise ValueError(f"routing table has two curves for {curve.key}")
            self._curves[curve.key] = curve
        self.meta: dict[str, object] = dict(meta or {})

    def __len__(self) -> int:
        return len(self._curves)

    def __repr__(self) -> str:
        return f"RoutingTable({[str(k) for k in self._curves]})"

    @property
    def keys(self) -> list[RoutingKey]:
        """The keys with a curve, in insertion order."""
        return list(self._curves)

    def curve(self, key: RoutingKey) -> RoutingCurve | None:
        """The curve measured for ``key``, or None.

        Args:
            key: the configuration.

        Returns:
            The curve or None (no nearest-key guessing: another page size or alpha is another curve).
        """
        return self._curves.get(key)

    def to_dict(self) -> dict[str, object]:
        """The JSON document of this table.

        Returns:
            ``{"schema": ROUTING_SCHEMA, "meta": {...}, "curves": [...]}``.
        """
        return {
            "schema": ROUTING_SCHEMA,
            "meta": dict(self.meta),
            "curves": [c.to_dict() for c in self._curves.values()],
        }

    @classmethod
    def from_dict(cls, data: object) -> RoutingTable:
        """Parse a table document.

        Args:
            data: the decoded JSON (see :meth:`to_dict`).

        Returns:
            The table.

        Raises:
            TypeError, ValueError: a malformed document (wrong schema, missing or bad members), naming the member.
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"routing table must be a JSON object, got {type(data).__name__}")
        schema = data.get("schema")
        if schema != ROUTING_SCHEMA:
            raise ValueError(f"routing table schema must be {ROUTING_SCHEMA!r}, got {schema!r}")
        curves = data.get("curves")
        if not isinstance(curves, list):
            raise TypeError(f"routing table 'curves' must be a list, got {type(curves).__name__}")
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise TypeError(f"routing table 'meta' must be a JSON object, got {type(meta).__name__}")
        return cls((RoutingCurve.from_dict(c, where=f"curves[{i}]") for i, c in enumerate(curves)), meta=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTable:
        """Read a table file written by :meth:`save` (or the measurement script).

        Args:
            path: the JSON file.

        Returns:
            The table.

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not JSON, or a malformed table (the message names the file).
            TypeError: a member has the wrong type.
        """
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"routing table {path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"routing table {path}: {exc}") from exc

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the table as JSON.

        Args:
            path: the target file (its folder is created).

        Returns:
            The written path.
        """
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return out


# --------------------------------------------------------------------------- decisions
def default_prefers_sparse(kv_len: int, config: SelectionConfig) -> bool:
    """The conservative rule without a measured curve: sparse from ``config.min_sparse_kv_len`` on.

    Below that length the sparse pipeline keeps every visible block anyway, so
    running its index stage there is pure overhead; at and above it, the
    pipeline behaves as without routing.

    Args:
        kv_len: the request's KV length (prefix included).
        config: the selection parameters.

    Returns:
        True for the sparse path.
    """
    return kv_len >= config.min_sparse_kv_len


@dataclass(frozen=True)
class RoutePlan:
    """Per-request routing decisions of one batch.

    Attributes:
        sparse: per request, True for the sparse path.
        q_lens: per request, new query tokens.
        kv_lens: per request, KV length (prefix included).
        source: ``"table"`` (a measured curve decided) or ``"default"`` (:func:`default_prefers_sparse`).
        reason: why that source (e.g. which key had no curve).
    """

    sparse: tuple[bool, ...]
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    source: str
    reason: str

    @property
    def sparse_requests(self) -> tuple[int, ...]:
        """Requests with queries routed to the sparse path (zero-length requests are in neither list)."""
        return tuple(b for b, (s, n) in enumerate(zip(self.sparse, self.q_lens)) if s and n > 0)

    @property
    def dense_requests(self) -> tuple[int, ...]:
        """Requests with queries routed to the dense path."""
        return tuple(b for b, (s, n) in enumerate(zip(self.sparse, self.q_lens)) if not s and n > 0)


class DensityRouter:
    """Decides per request between the dense path and the sparse pipeline.

    Args:
        table: a :class:`RoutingTable`, a path to its JSON file, :data:`MEASURED` (the default:
            the table measured on this GPU model and shipped with the package, if there is one)
            or None (the default rule only).
        config: the selection parameters of the sparse path (None: defaults); the default rule
            reads its ``min_sparse_kv_len``.
        min_speedup: with a curve, route to sparse only where it is expected to be faster
            than dense by more than this factor (>= 1; 1: any gain, ties go dense).
        floor_kv_len: with a curve, never route requests shorter than this to sparse
            (None: no floor, the measured curve decides alone).

    Raises:
        TypeError: wrong argument types.
        ValueError: ``min_speedup < 1`` or a negative ``floor_kv_len``; a malformed table file.
    """

    def __init__(
        self,
        table: RoutingTable | str | os.PathLike[str] | _Measured | None = MEASURED,
        *,
        config: SelectionConfig | None = None,
        min_speedup: float = 1.0,
        floor_kv_len: int | None = None,
    ) -> None:
        if isinstance(table, _Measured):
            from .routing_measured import measured_table  # the shipped measurements import this module

            table = measured_table()
        if isinstance(table, (str, os.PathLike)):
            table = RoutingTable.load(table)
        elif table is not None and not isinstance(table, RoutingTable):
            raise TypeError(f"table must be a RoutingTable, a path or None; got {type(table).__name__}")
        if config is None:
            config = SelectionConfig()
        elif not isinstance(config, SelectionConfig):
            raise TypeError(f"config must be a fpv2.index.SelectionConfig; got {type(config).__name__}")
        if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)):
            raise TypeError(f"min_speedup must be a float, got {type(min_speedup).__name__}")
        if not (math.isfinite(min_speedup) and min_speedup >= 1.0):
            raise ValueError(f"min_speedup must be finite and >= 1, got {min_speedup}")
        if floor_kv_len is not None:
            _int_field("DensityRouter", "floor_kv_len", floor_kv_len, 0)
        self.table = table
        self.config = config
        self.min_speedup = float(min_speedup)
        self.floor_kv_len = floor_kv_len

    def __repr__(self) -> str:
        return (
            f"DensityRouter(table={self.table!r}, min_speedup={self.min_speedup:g}, floor_kv_len={self.floor_kv_len}, "
            f"min_sparse_kv_len={self.config.min_sparse_kv_len})"
        )

    def curve_for(self, key: RoutingKey) -> RoutingCurve | None:
        """The measured curve the router uses for ``key`` (None: the default rule applies).

        Args:
            key: the configuration.

        Returns:
            The curve or None.
        """
        return self.table.curve(key) if self.table is not None else None

    def prefers_sparse(self, kv_len: int, key: RoutingKey | None) -> bool:
        """Route one request of KV length ``kv_len``.

        Args:
            kv_len: KV length, prefix included.
            key: the configuration (None: the default rule).

        Returns:
            True for the sparse path.
        """
        curve = self.curve_for(key) if key is not None else None
        if curve is None:
            return default_prefers_sparse(kv_len, self.config)
        if self.floor_kv_len is not None and kv_len < self.floor_kv_len:
            return False
        return curve.prefers_sparse(kv_len, min_speedup=self.min_speedup)

    def plan(self, q_lens: Sequence[int], kv_lens: Sequence[int], key: RoutingKey | None) -> RoutePlan:
        """Route every request of a batch given its host lengths.

        Args:
            q_lens: new queries per request.
            kv_lens: KV length per request (prefix included).
            key: the configuration (None: the default rule).

        Returns:
            The :class:`RoutePlan`.

        Raises:
            ValueError: the two lists differ in length or a length is negative.
        """
        q_lens, kv_lens = tuple(int(n) for n in q_lens), tuple(int(k) for k in kv_lens)
        if len(q_lens) != len(kv_lens):
            raise ValueError(
                f"q_lens and kv_lens must have one entry per request; got {len(q_lens)} and {len(kv_lens)}"
            )
        if any(n < 0 for n in q_lens) or any(k < n for n, k in zip(q_lens, kv_lens)):
            raise ValueError(f"lengths must satisfy 0 <= q_len <= kv_len; got q_lens {q_lens}, kv_lens {kv_lens}")
        curve = self.curve_for(key) if key is not None else None
        if curve is not None:
            source, reason = "table", f"measured curve for {key}"
        elif key is None or self.table is None:
            source, reason = (
                "default",
                f"no routing table: sparse from min_sparse_kv_len={self.config.min_sparse_kv_len}",
            )
        else:
            source = "default"
            reason = f"no measured curve for {key}: sparse from min_sparse_kv_len={self.config.min_sparse_kv_len}"
        sparse = tuple(self.prefers_sparse(k, key) for k in kv_lens)
        return RoutePlan(sparse=sparse, q_lens=q_lens, kv_lens=kv_lens, source=source, reason=reason)

    def route(self, batch: PagedPrefillBatch, key: RoutingKey | None) -> RoutePlan:
        """Route every request of ``batch`` (reads ``batch.host``: one sync unless the host view is seeded).

        Args:
            batch: the prefill batch.
            key: the configuration (None: the default rule).

        Returns:
            The :class:`RoutePlan`.
        """
        host = batch.host
        return self.plan(host.q_lens, host.seqlens_k, key)


# ---------------------------------------------------------------------- split / merge
@dataclass(frozen=True, eq=False)
class SubBatch:
    """Some requests of a parent batch, over the same KV cache.

    Attributes:
        requests: indices of the requests in the parent batch, ascending.
        batch: the sub-batch (its host view seeded from the parent's).
        q: ``(sub_total_q, Hq, d)`` queries of those requests (a view when their rows are contiguous).
        rows: ``(sub_total_q,) int64`` parent rows of ``q``, on the device.
        row_range: ``(begin, end)`` when those rows are one contiguous range of the parent, else None.
        descales: FP8 descales of those requests (``q_descale``, ``k_descale``, ``v_descale``), present ones only.
    """

    requests: tuple[int, ...]
    batch: PagedPrefillBatch
    q: torch.Tensor
    rows: torch.Tensor
    row_range: tuple[int, int] | None
    descales: dict[str, torch.Tensor]


def split_batch(
    q: torch.Tensor,
    batch: PagedPrefillBatch,
    requests: Sequence[int],
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> SubBatch:
    """The sub-batch of ``requests``: their rows of the metadata and their query rows.

    The sub-batch reads the same KV cache through the selected rows of the page
    table. One small int32 vector goes to the device (non-blocking); rows are
    gathered on the device, so no host synchronisation is added (``batch.host``
    must be available: it is read, or the caller seeded it).

    Args:
        q: ``(total_q, Hq, d)`` queries of the parent batch.
        batch: the parent batch.
        requests: parent request indices, strictly ascending, at least one.
        q_descale: ``(B, Hkv)`` FP8 query descales of the parent, or None.
        k_descale: FP8 key descales of the parent, or None.
        v_descale: FP8 value descales of the parent, or None.

    Returns:
        The :class:`SubBatch`.

    Raises:
        TypeError: ``requests`` holds non-ints.
        ValueError: empty, unordered or out-of-range ``requests``; ``q`` rows disagree with the batch.
    """
    requests = tuple(requests)
    for b in requests:
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"requests must hold ints, got {type(b).__name__} {b!r}")
    num = batch.num_requests
    if not requests or any(b < 0 or b >= num for b in requests) or any(a >= b for a, b in itertools.pairwise(requests)):
        raise ValueError(f"requests must be strictly ascending indices in 0..{num - 1}, at least one; got {requests}")
    host = batch.host
    if q.shape[0] != host.cu_seqlens_q[-1]:
        raise ValueError(
            f"q must hold cu_seqlens_q[-1]={host.cu_seqlens_q[-1]} rows; got shape {tuple(q.shape)}, dtype {q.dtype}"
        )
    q_lens = [host.q_lens[b] for b in requests]
    kv_lens = [host.seqlens_k[b] for b in requests]
    starts = [host.cu_seqlens_q[b] for b in requests]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    total = cu[-1]
    n = len(requests)
    device = batch.device
    # One host vector, one non-blocking copy from pinned memory: [requests | cu (n+1) | seqlens_k (n) | starts (n)].
    packed = device_ints([*requests, *cu, *kv_lens, *starts], device)
    req_index = packed[:n]
    cu_dev = packed[n : 2 * n + 1]
    seqlens_dev = packed[2 * n + 1 : 3 * n + 1]
    starts_dev = packed[3 * n + 1 : 4 * n + 1]
    page_table = batch.page_table.index_select(0, req_index)
    sub = PagedPrefillBatch(
        cu_seqlens_q=cu_dev,
        seqlens_k=seqlens_dev,
        page_table=page_table,
        page_size=batch.page_size,
        num_pages=batch.num_pages,
        check_values=False,
    ).assume_host_view(HostBatchView(cu_seqlens_q=cu, seqlens_k=kv_lens))
    first = starts[0]
    contiguous = host.cu_seqlens_q[requests[-1] + 1] - first == total
    if contiguous:
        rows = torch.arange(first, first + total, dtype=torch.int64, device=device)
        q_sub = q[first : first + total]
        row_range: tuple[int, int] | None = (first, first + total)
    else:
        # Parent row of sub row r of request i: starts[i] + (r - cu[i]), expanded on the device.
        lens_dev = (cu_dev[1:] - cu_dev[:-1]).long()
        shift = (starts_dev - cu_dev[:-1]).long()
        rows = torch.arange(total, dtype=torch.int64, device=device)
        rows += torch.repeat_interleave(shift, lens_dev, output_size=total)
        q_sub = q.index_select(0, rows)
        row_range = None
    descales = {}
    for name, scale in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if scale is not None:
            descales[name] = scale.index_select(0, req_index).contiguous()
    return SubBatch(requests, sub, q_sub, rows, row_range, descales)


def merge_outputs(
    parts: Sequence[tuple[SubBatch, torch.Tensor]],
    *,
    total_q: int,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """Put sub-batch outputs back in the parent's row order.

    Args:
        parts: ``(sub-batch, its (sub_total_q, Hq, d) output)`` pairs; their rows must
            cover every parent row exactly once (zero-length requests have none).
        total_q: rows of the parent batch.
        like: a tensor whose shape tail, dtype and device the output takes when ``parts``
            is empty (then ``total_q`` must be 0).

    Returns:
        ``(total_q, Hq, d)`` merged output.

    Raises:
        ValueError: the parts do not cover ``total_q`` rows, or disagree in shape, dtype or device.
    """
    covered = sum(int(sub.q.shape[0]) for sub, _ in parts)
    if covered != total_q:
        raise ValueError(f"sub-batch outputs cover {covered} rows, the parent batch has {total_q}")
    if not parts:
        if like is None:
            raise ValueError("merge_outputs needs `like` when there are no parts")
        return like.new_empty((0, *like.shape[1:]))
    ref = parts[0][1]
    for sub, out in parts:
        if out.shape[0] != sub.q.shape[0] or out.shape[1:] != ref.shape[1:]:
            raise ValueError(
                f"sub-batch output has shape {tuple(out.shape)}; expected ({sub.q.shape[0]}, *{tuple(ref.shape[1:])})"
            )
        if out.dtype != ref.dtype or out.device != ref.device:
            raise ValueError(f"sub-batch outputs disagree: {out.dtype} on {out.device} vs {ref.dtype} on {ref.device}")
    if len(parts) == 1 and parts[0][0].row_range == (0, total_q):
        return parts[0][1]
    merged = ref.new_empty((total_q, *ref.shape[1:]))
    for sub, out in parts:
        if sub.row_range is not None:
            merged[sub.row_range[0] : sub.row_range[1]] = out
        else:
            merged.index_copy_(0, sub.rows, out)
    return merged


# ------------------------------------------------------------------------- dense path
def kernel_dense_mode(backend: AttentionBackend) -> DenseRunner | None:
    """The backend's kernel dense mode, if it offers one.

    A backend offers it through a ``run_dense(q, k_cache, v_cache, batch, *, softmax_scale,
    q_descale, k_descale, v_descale)`` method (the built-in Triton backend does: its kernel
    runs dense with no index). Other backends (the reference, the Hopper backend until it
    grows ``run_dense``) have none.

    Args:
        backend: the attention backend.

    Returns:
        The dense runner, or None.
    """
    run_dense = getattr(backend, "run_dense", None)
    return run_dense if callable(run_dense) else None


# --------------------------------------------------------------------- the pipeline
@dataclass(frozen=True, eq=False)
class RoutedPrefillResult:
    """Output of one routed call and how it was produced.

    Attributes:
        out: ``(total_q, Hq, d)`` attention output in the parent's row order.
        plan: the routing decisions.
        sparse: the sparse pipeline's result on the sparse sub-batch (None: nothing routed there).
        sparse_batch: the batch the sparse pipeline ran on (the parent itself when unsplit).
        dense_batch: the batch the dense path ran on (None: nothing routed there).
        dense_path: ``"kernel"`` or ``"strategy"``: which dense path ran (None: none).
    """

    out: torch.Tensor
    plan: RoutePlan
    sparse: PrefillResult | None
    sparse_batch: PagedPrefillBatch | None
    dense_batch: PagedPrefillBatch | None
    dense_path: str | None


class RoutedPrefillPipeline:
    """Sparse prefill with density routing: short requests dense, long ones through the sparse pipeline.

    Args:
        config: selection parameters of the sparse path (None: defaults). With a measured
            curve the sparse path runs with ``min_sparse_kv_len = 0`` (routing decided);
            without, the default rule routes exactly the requests the sparse pipeline would
            not keep dense, so its outputs match the unrouted pipeline's.
        table: a :class:`RoutingTable`, a path to its JSON, :data:`MEASURED` (the default: the
            shipped measurement of this GPU model, see :mod:`fpv2.serving.routing_measured`) or None
            (the default rule).
        strategy: selection strategy of the sparse path.
        correction: mean correction on the sparse path.
        backend: ``"auto"``, a backend name or object, shared by both paths.
        dense_mode: ``"auto"`` (the kernel's dense mode when the backend offers one, else the
            ``dense`` strategy), ``"kernel"`` (require the kernel's dense mode) or
            ``"strategy"`` (the backend with the ``dense`` strategy and no correction).
        min_speedup: see :class:`DensityRouter`.
        floor_kv_len: see :class:`DensityRouter`.

    Raises:
        TypeError, ValueError: bad options (as :class:`~.pipeline.SparsePrefillPipeline` and
            :class:`DensityRouter`); ``dense_mode="kernel"`` with a backend without one.
        RuntimeError: the backend is not available.
    """

    def __init__(
        self,
        config: SelectionConfig | None = None,
        *,
        table: RoutingTable | str | os.PathLike[str] | _Measured | None = MEASURED,
        strategy: str = "max_threshold",
        correction: bool = True,
        backend: str | AttentionBackend = AUTO,
        dense_mode: str = "auto",
        min_speedup: float = 1.0,
        floor_kv_len: int | None = None,
    ) -> None:
        self.router = DensityRouter(table, config=config, min_speedup=min_speedup, floor_kv_len=floor_kv_len)
        self.config = self.router.config
        # The router owns the short-request fallback: the sparse path never re-applies it.
        sparse_config = dataclasses.replace(self.config, min_sparse_kv_len=0)
        self.sparse_pipeline = SparsePrefillPipeline(
            sparse_config, strategy=strategy, correction=correction, backend=backend
        )
        self.backend = self.sparse_pipeline.backend
        if dense_mode not in DENSE_MODES:
            raise ValueError(f"dense_mode must be one of {DENSE_MODES}, got {dense_mode!r}")
        runner = kernel_dense_mode(self.backend) if dense_mode != "strategy" else None
        if dense_mode == "kernel" and runner is None:
            raise ValueError(f"backend {self.backend.name!r} offers no kernel dense mode; use dense_mode='strategy'")
        self._dense_runner = runner
        self.dense_path = "kernel" if runner is not None else "strategy"
        self.dense_pipeline = SparsePrefillPipeline(
            sparse_config, strategy=DENSE_STRATEGY, correction=False, backend=self.backend
        )

    def __repr__(self) -> str:
        return (
            f"RoutedPrefillPipeline(router={self.router!r}, sparse={self.sparse_pipeline!r}, "
            f"dense_path={self.dense_path!r})"
        )

    def run_dense(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        **descales: torch.Tensor | None,
    ) -> torch.Tensor:
        """The dense path alone (what the router sends short requests to).

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            k_cache: paged keys.
            v_cache: paged values.
            batch: the batch.
            **descales: ``q_descale``, ``k_descale``, ``v_descale`` for FP8 inputs.

        Returns:
            ``(total_q, Hq, d)`` dense causal attention.
        """
        if self._dense_runner is not None:
            scale = self.config.scale_for(q.shape[2])
            kw = {name: descales.get(name) for name in ("q_descale", "k_descale", "v_descale")}
            return self._dense_runner(q, k_cache, v_cache, batch, softmax_scale=scale, **kw)
        return self.dense_pipeline(q, k_cache, v_cache, batch, **descales).out

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedPrefillBatch,
        *,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
    ) -> RoutedPrefillResult:
        """Route, split, run both paths, merge.

        A batch routed entirely one way runs unsplit. Zero-length requests produce no
        rows and join whichever sub-batch runs on the whole batch, or none.

        Args:
            q: ``(total_q, Hq, d)`` packed queries.
            k_cache: ``(num_pages, page_size, Hkv, d)`` paged keys.
            v_cache: paged values.
            batch: the batch metadata.
            q_descale: ``(B, Hkv) float32`` FP8 query descales.
            k_descale: FP8 key descales.
            v_descale: FP8 value descales.

        Returns:
            The :class:`RoutedPrefillResult`.

        Raises:
            TypeError, ValueError: invalid inputs (named, with shape and dtype).
        """
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        validate_prefill_inputs(q, k_cache, v_cache, batch, **descales)
        key = RoutingKey.from_inputs(q, k_cache, batch, self.config)
        plan = self.router.route(batch, key)
        sparse_reqs, dense_reqs = plan.sparse_requests, plan.dense_requests
        if not sparse_reqs and not dense_reqs:  # no queries at all
            out = torch.empty(q.shape, dtype=output_dtype(q.dtype), device=q.device)
            return RoutedPrefillResult(out, plan, None, None, None, None)
        if not dense_reqs:
            result = self.sparse_pipeline(q, k_cache, v_cache, batch, **descales)
            return RoutedPrefillResult(result.out, plan, result, batch, None, None)
        if not sparse_reqs:
            out = self.run_dense(q, k_cache, v_cache, batch, **descales)
            return RoutedPrefillResult(out, plan, None, None, batch, self.dense_path)
        sparse_sub = split_batch(q, batch, sparse_reqs, **descales)
        dense_sub = split_batch(q, batch, dense_reqs, **descales)
        result = self.sparse_pipeline(sparse_sub.q, k_cache, v_cache, sparse_sub.batch, **sparse_sub.descales)
        dense_out = self.run_dense(dense_sub.q, k_cache, v_cache, dense_sub.batch, **dense_sub.descales)
        out = merge_outputs([(sparse_sub, result.out), (dense_sub, dense_out)], total_q=q.shape[0])
        return RoutedPrefillResult(out, plan, result, sparse_sub.batch, dense_sub.batch, self.dense_path)
