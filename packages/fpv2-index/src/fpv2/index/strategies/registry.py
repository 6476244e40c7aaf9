"""Strategy registry: built-in strategies, strategies registered at run time, and plugins.

Third-party packages publish strategies through the entry-point group
:data:`ENTRY_POINT_GROUP`; the entry point's name is the strategy name and its
object a strategy class (instantiated without arguments) or instance, e.g. in
``pyproject.toml``::

    [project.entry-points."fpv2.index.strategies"]
    my_topk = "my_package.selection:TopKStrategy"

Entry points are looked up when a name is not registered, and loaded on first
use. Names registered in-process (the built-ins included) take precedence over
entry points of the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any, TypeVar, overload

from .base import SelectionStrategy

#: Entry-point group scanned for third-party strategies.
ENTRY_POINT_GROUP = "fpv2.index.strategies"

_REGISTRY: dict[str, SelectionStrategy] = {}

T = TypeVar("T")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"strategy name must be a non-empty str, got {name!r}")
    return name


def _instantiate(obj: Any, origin: str) -> SelectionStrategy:
    """A strategy instance from a class or an instance, checked against the protocol."""
    strategy = obj() if isinstance(obj, type) else obj
    if not isinstance(strategy, SelectionStrategy):
        raise TypeError(
            f"{origin} is not a SelectionStrategy: it needs a 'name' attribute and a 'select' method; "
            f"got {type(strategy).__name__}"
        )
    return strategy


@overload
def register_strategy(name: str, strategy: None = None, *, replace: bool = False) -> Callable[[T], T]: ...
@overload
def register_strategy(name: str, strategy: T, *, replace: bool = False) -> T: ...
def register_strategy(name: str, strategy: Any = None, *, replace: bool = False) -> Any:
    """Register a strategy under ``name``; usable as a function or as a class decorator.

    Args:
        name: the strategy name, as passed to :func:`get_strategy`.
        strategy: a strategy class (instantiated without arguments) or instance.
            When omitted, returns a decorator registering what it decorates.
        replace: allow replacing an already registered strategy of that name.

    Returns:
        ``strategy`` unchanged (or a decorator when ``strategy`` is None).

    Raises:
        TypeError: ``name`` is not a non-empty string or ``strategy`` lacks ``name``/``select``.
        ValueError: ``name`` is registered already and ``replace`` is False.
    """
    _check_name(name)
    if strategy is None:

        def decorator(obj: T) -> T:
            register_strategy(name, obj, replace=replace)
            return obj

        return decorator
    if name in _REGISTRY and not replace:
        raise ValueError(f"a selection strategy named {name!r} is registered already; pass replace=True to replace it")
    _REGISTRY[name] = _instantiate(strategy, f"strategy {name!r}")
    return strategy


def unregister_strategy(name: str) -> None:
    """Remove a strategy registered in-process (entry points stay discoverable).

    Args:
        name: the registered name.

    Raises:
        KeyError: nothing is registered under ``name``.
    """
    if name not in _REGISTRY:
        raise KeyError(f"no selection strategy named {name!r} is registered")
    del _REGISTRY[name]


def _entry_points() -> dict[str, metadata.EntryPoint]:
    """Entry points of :data:`ENTRY_POINT_GROUP` by name (read afresh, so new installs show up)."""
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_strategies() -> list[str]:
    """Names of every registered and discoverable strategy.

    Returns:
        Sorted strategy names, built-ins and entry points included.
    """
    return sorted(set(_REGISTRY) | set(_entry_points()))


def get_strategy(name: str) -> SelectionStrategy:
    """The strategy registered (or published as an entry point) under ``name``.

    Args:
        name: strategy name, e.g. ``"max_threshold"`` or ``"dense"``.

    Returns:
        The shared strategy instance.

    Raises:
        TypeError: ``name`` is not a string, or the entry point's object is not a strategy.
        ValueError: no strategy has that name; the message lists the available ones.
        ImportError: the entry point of that name fails to load.
    """
    _check_name(name)
    if name in _REGISTRY:
        return _REGISTRY[name]
    entry = _entry_points().get(name)
    if entry is None:
        raise ValueError(
            f"unknown selection strategy {name!r}; available strategies: {', '.join(available_strategies())}"
        )
    try:
        obj = entry.load()
    except Exception as exc:  # report which plugin is broken, not just the inner error
        raise ImportError(
            f"selection strategy {name!r} from entry point {entry.value!r} (group {ENTRY_POINT_GROUP}) failed to "
            f"load: {exc}"
        ) from exc
    strategy = _instantiate(obj, f"entry point {name!r} = {entry.value!r}")
    _REGISTRY[name] = strategy
    return strategy
