"""Per-request, per-layer chunked-prefill states held by an engine adapter between forwards.

An engine prefills a long prompt in chunks, one chunk per forward, and each
forward runs every layer. :class:`~.chunked.ChunkedPrefillPipeline` needs the
request's :class:`~.chunked_state.ChunkedPrefillState` of the same layer at
every chunk; the engine only hands the adapter its request ids and lengths.
:class:`ChunkStateRegistry` keeps those states keyed by ``(request id, layer)``:

- a chunk that ends before its prompt does (``prefix + q_len < prompt_len``)
  keeps its state for the next chunk; the prompt's last chunk (and every
  request prefilled in one forward, and a decode row of a mixed batch) gets a
  state that is dropped after the layer's call, so nothing outlives a prefill;
- a state that no longer matches its request (another prompt length, a chunk
  before its prefill start: the KV was recomputed after preemption, or the id
  was reused) is replaced by a fresh one; a fresh state pools the whole visible
  prefix at its first chunk, so any state, even a lost one, gives a correct
  chunk, only not the unchunked call's tiling;
- states of requests absent from the current forward are dropped, least
  recently used first, while the states held exceed ``budget_bytes`` (an
  aborted request's states go this way). States the current forward uses are
  never dropped.

Nothing here synchronises with the device: sizes are the states' buffer sizes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from fpv2.kernel.contracts import BLOCK_SIZE

from .chunked_state import ChunkedPrefillState

#: Default memory for states of requests between their chunks (pooled K/V in fp32: 8 MiB a layer for a
#: 128K prompt at 8 KV heads of 128 and 128-token blocks, 256 MiB for 32 layers).
DEFAULT_BUDGET_BYTES = 2 << 30


@dataclass(frozen=True)
class ChunkRequest:
    """One request's chunk in a forward, as the engine describes it.

    Attributes:
        key: the engine's request id (any hashable; SGLang's ``rid``).
        prefix: KV tokens before the chunk's first query.
        q_len: queries of the chunk.
        prompt_len: KV length once the request's prompt is prefilled (cached prefix included),
            or None when the engine does not say (then every state is kept until its request
            leaves the forwards and the budget drops it).

    Raises:
        ValueError: a negative or non-int length, or a chunk that ends past ``prompt_len``.
    """

    key: Hashable
    prefix: int
    q_len: int
    prompt_len: int | None

    def __post_init__(self) -> None:
        for name in ("prefix", "q_len", "prompt_len"):
            value = getattr(self, name)
            if value is None and name == "prompt_len":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ChunkRequest.{name} must be an int >= 0; got {value!r} (request {self.key!r})")
        if self.prompt_len is not None and self.prefix + self.q_len > self.prompt_len:
            raise ValueError(
                f"request {self.key!r}: the chunk ends at KV position {self.prefix + self.q_len}, past its "
                f"prompt_len={self.prompt_len}"
            )

    @property
    def ends_prompt(self) -> bool:
        """Whether this chunk completes the prompt (its state is not needed afterwards)."""
        return self.prompt_len is not None and self.prefix + self.q_len >= self.prompt_len

    @property
    def continues(self) -> bool:
        """Whether a later chunk of the same prompt follows this one."""
        return not self.ends_prompt


@dataclass
class RegistryCounters:
    """What the registry did, for diagnostics and tests.

    Attributes:
        created: states made (kept or transient).
        resumed: chunks that found their request's state from an earlier chunk.
        replaced: held states dropped because they no longer matched their request.
        finished: held states dropped because their prompt's last chunk ran.
        evicted: held states dropped for the budget.
    """

    created: int = 0
    resumed: int = 0
    replaced: int = 0
    finished: int = 0
    evicted: int = 0


class ChunkStateRegistry:
    """The chunked-prefill states an engine adapter holds between forwards.

    Call :meth:`begin_forward` once per forward with the forward's requests,
    then :meth:`states_for` once per layer, just before the layer's chunk runs.

    Args:
        budget_bytes: memory for states of requests absent from the current forward; beyond it the
            least recently used requests' states are dropped at :meth:`begin_forward`.
        block_size: tokens per pooled key block of the states (the selection's ``block_size``).

    Raises:
        TypeError: an argument is not an int.
        ValueError: a negative budget or a block size below 1.
    """

    def __init__(self, *, budget_bytes: int = DEFAULT_BUDGET_BYTES, block_size: int = BLOCK_SIZE) -> None:
        for name, value, minimum in (("budget_bytes", budget_bytes, 0), ("block_size", block_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}; got {value}")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.counters = RegistryCounters()
        # request key -> {layer -> state}, least recently used request first.
        self._held: OrderedDict[Hashable, dict[Hashable, ChunkedPrefillState]] = OrderedDict()
        self._current: set[Hashable] = set()  # keys of the current forward's requests

    def __len__(self) -> int:
        """States held between forwards (over all requests and layers)."""
        return sum(len(layers) for layers in self._held.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of the held states' buffers (their pooled K/V, lengths and tile pages)."""
        return sum(_state_bytes(s) for layers in self._held.values() for s in layers.values())

    def requests(self) -> tuple[Hashable, ...]:
        """Keys of the requests with held states, least recently used first."""
        return tuple(self._held)

    def get(self, key: Hashable, layer: Hashable) -> ChunkedPrefillState | None:
        """The state held for one request and layer, or None.

        Args:
            key: the request key.
            layer: the layer key.

        Returns:
            The held :class:`ChunkedPrefillState` (None once its prompt's last chunk ran).
        """
        return self._held.get(key, {}).get(layer)

    def begin_forward(self, requests: Sequence[ChunkRequest]) -> bool:
        """Start a forward: remember its requests and keep the idle states within the budget.

        Args:
            requests: the forward's requests, in batch order (keys unique).

        Returns:
            Whether any request of the forward needs the chunk-aware path: a chunk that a later one
            continues, or a request with held states. Otherwise the plain per-call pipeline gives the
            same selection, and the caller may run it.

        Raises:
            ValueError: a key appears twice.
        """
        current: set[Hashable] = set()
        for request in requests:
            if request.key in current:
                raise ValueError(f"request key {request.key!r} appears twice in one forward")
            current.add(request.key)
        self._current = current
        for key in current:
            if key in self._held:
                self._held.move_to_end(key)
        self._evict_idle()
        return any(r.continues or r.key in self._held for r in requests)

    def states_for(self, layer: Hashable, requests: Sequence[ChunkRequest]) -> list[ChunkedPrefillState]:
        """The states of one layer's chunk, in batch order; a prompt's last chunk releases its state.

        Args:
            layer: the layer key (e.g. the layer id).
            requests: the forward's requests, as given to :meth:`begin_forward`.

        Returns:
            One :class:`ChunkedPrefillState` per request. States of chunks that end their prompt are no
            longer held once returned; the caller uses them for this call only.
        """
        states = []
        for request in requests:
            layers = self._held.get(request.key)
            state = None if layers is None else layers.get(layer)
            if state is not None and not _matches(state, request):
                del layers[layer]
                self.counters.replaced += 1
                state = None
            if state is None:
                state = ChunkedPrefillState(
                    prompt_len=request.prompt_len, prefill_start=request.prefix, block_size=self.block_size
                )
                self.counters.created += 1
            else:
                self.counters.resumed += 1
            if request.continues:
                self._held.setdefault(request.key, {})[layer] = state
            elif layers is not None and layers.pop(layer, None) is not None:
                self.counters.finished += 1
            if layers is not None and not layers:
                self._held.pop(request.key, None)
            states.append(state)
        return states

    def release(self, key: Hashable) -> None:
        """Drop every state of one request (e.g. when the engine aborts it).

        Args:
            key: the request key; unknown keys are ignored.
        """
        self._held.pop(key, None)

    def clear(self) -> None:
        """Drop every held state."""
        self._held.clear()
        self._current = set()

    def _evict_idle(self) -> None:
        """Drop idle requests' states, least recently used first, while the held bytes exceed the budget."""
        total = self.held_bytes
        for key in list(self._held):
            if total <= self.budget_bytes:
                return
            if key in self._current:
                continue
            layers = self._held.pop(key)
            total -= sum(_state_bytes(s) for s in layers.values())
            self.counters.evicted += len(layers)


def _matches(state: ChunkedPrefillState, request: ChunkRequest) -> bool:
    """Whether a held state can serve the request's chunk: the same prompt, a chunk inside its prefill.

    A ``ChunkRequest`` never ends past its own ``prompt_len``, so equal prompt lengths bound the chunk's end.
    """
    return state.prompt_len == request.prompt_len and request.prefix >= state.prefill_start


def _state_bytes(state: ChunkedPrefillState) -> int:
    """Bytes of a state's device buffers."""
    buffers = (state.pooled_k, state.pooled_v, state.block_lengths, state.tile_k, state.tile_v, state.tile_table)
    return sum(b.numel() * b.element_size() for b in buffers if b is not None)
