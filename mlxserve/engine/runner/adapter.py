"""The engine's view of a model: per-sequence state, prefill, one logits step, rollback.

Keeping this narrow lets one engine serve any mlx-lm model (`PlainAdapter`)
and DeepSeek-V4 with its MTP drafter (`mlxserve.engine.spec.mtp`) or its DSpark
head (`mlxserve.engine.spec.dspark`), and
keeps model-specific cache handling out of the scheduler.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache

from mlxserve.hardware.tuning import EngineTuning, default_tuning, tune_model
from mlxserve.kernels.buffers import own_buffers

if TYPE_CHECKING:
    from mlxserve.channel.request import SamplingParams
    from mlxserve.engine.sample.logits import TokenChooser
    from mlxserve.engine.sample.sampling import Draws
    from mlxserve.engine.spec.costs import RoundCosts
    from mlxserve.engine.spec.depth import DepthPicker


class ModelState(Protocol):
    """Everything one sequence keeps between steps (caches, carried hidden states)."""

    @property
    def offset(self) -> int: ...


class ModelAdapter(Protocol):
    #: deepest speculative draft the model supports (0: no drafter)
    max_draft_depth: int
    #: the knobs its forwards and batches run with (`tune`)
    tuning: EngineTuning

    def tune(self, tuning: EngineTuning) -> None:
        """Run with these knobs from now on, the model's forwards too."""

    def new_state(self, max_rollback: int) -> ModelState: ...

    def prefill(self, state: ModelState, tokens: list[int]) -> None:
        """Add prompt tokens to the state; no logits are needed for them."""

    def step(self, state: ModelState, tokens: mx.array) -> mx.array:
        """Add `tokens` ([n], may be lazy) and return the logits [vocab] of the last, lazily."""

    def snapshot(self, state: ModelState) -> ModelState:
        """An independent copy, for the prefix cache."""

    def compact(self, state: ModelState) -> None:
        """Give each of the state's arrays a buffer of its own size, in place, before the
        prefix cache keeps it: an evaluated slice shares its source's whole buffer, so a
        kept window or a cache grown in steps would pin more than it counts."""

    def nbytes(self, state: ModelState) -> int: ...


def _is_compact(cache: Any) -> bool:
    """A plain KV cache allocated at exactly its length (a copy made by `_compact_copy`)."""
    keys = getattr(cache, "keys", None)
    return type(cache) is KVCache and keys is not None and keys.shape[2] == cache.offset


def _compact_copy(cache: Any, keep: int | None = None) -> Any:
    """A copy of `cache`: a plain KV cache at its length (or its first ``keep``
    positions), in buffers of its own (`mlxserve.kernels.buffers`); any other cache
    deep-copied (sharing its buffers)."""
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if type(cache) is not KVCache or keys is None or values is None:
        return copy.deepcopy(cache)
    length = cache.offset if keep is None else min(keep, cache.offset)
    out = KVCache()  # type: ignore[no-untyped-call]
    out.keys, out.values = own_buffers([keys[..., :length, :], values[..., :length, :]])
    out.offset = length
    return out


def _compacted(cache: Any) -> Any:
    """`cache` in buffers of its own size: a plain KV cache copied at its length (unless
    it is), a cache that compacts itself (DeepSeek-V4's) compacted, any other cache's
    flat list of arrays copied in place (where it may be set)."""
    if type(cache) is KVCache:
        return cache if cache.keys is None or _is_compact(cache) else _compact_copy(cache)
    if callable(getattr(cache, "compact", None)):
        cache.compact()
        return cache
    settable = getattr(type(cache), "state", None)
    if isinstance(settable, property) and settable.fset is None:
        return cache  # its arrays cannot be replaced (mlx-lm's deepseek_v41 caches): kept
    state = getattr(cache, "state", None)
    if isinstance(state, list | tuple) and all(a is None or isinstance(a, mx.array) for a in state):
        copies = iter(own_buffers(a for a in state if a is not None))
        cache.state = [None if a is None else next(copies) for a in state]
    return cache


#: positions a plain KV cache grows by past its reservation (mlx-lm grows by 256)
GROWTH_STEP = 64


@runtime_checkable
class SupportsReserve(Protocol):
    """An adapter that allocates a prompt's caches once, for the whole prompt."""

    def reserve(self, state: ModelState, positions: int) -> None: ...


@runtime_checkable
class SupportsTrim(Protocol):
    """An adapter whose states can drop their last positions, so a prefix-cache entry
    serves a prompt that shares only its start (`PrefixCache.lookup`)."""

    def trimmed(self, state: ModelState, keep: int) -> ModelState | None:
        """An independent copy of ``state`` holding its first ``keep`` positions, or
        None where its caches cannot drop positions (a sliding window that wrapped)."""


@runtime_checkable
class SupportsSpeculation(Protocol):
    """An adapter with a drafter: a draft + verify round, plainly and under a
    `TokenChooser`, and the costs the automatic depth starts from. Each round returns
    (tokens to emit, drafted, accepted)."""

    def speculate(
        self, state: Any, last_token: int, depth: int, params: SamplingParams, draws: Draws
    ) -> tuple[list[int], int, int]: ...

    def speculate_chosen(
        self,
        state: Any,
        last_token: int,
        depth: int,
        chooser: TokenChooser,
        draws: Draws,
        remaining: int,
    ) -> tuple[list[int], int, int]: ...

    def measure_costs(
        self, tick: Callable[[], None] = ..., clock: Callable[[], float] = ...
    ) -> RoundCosts: ...


@runtime_checkable
class SupportsAdaptiveVerification(Protocol):
    """A drafter that judges its own drafts (DSpark's confidence head): it verifies
    only those worth it and tells the automatic depth its confidences per position."""

    def follow(self, picker: DepthPicker) -> None: ...


class PlainState:
    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        # Positions the caches are allocated for at their next growth (``reserve``).
        self.reserved = 0

    @property
    def offset(self) -> int:
        return int(getattr(self.cache[0], "offset", 0)) if self.cache else 0


class PlainAdapter:
    """Any mlx-lm model: its own cache (`make_cache` or mlx-lm's KV caches)."""

    max_draft_depth = 0

    def __init__(self, model: Module) -> None:
        self.model = model
        self.tuning = default_tuning()

    def tune(self, tuning: EngineTuning) -> None:
        self.tuning = tuning
        tune_model(self.model, tuning)

    def new_state(self, max_rollback: int) -> PlainState:
        return PlainState(make_prompt_cache(self.model))

    def reserve(self, state: ModelState, positions: int) -> None:
        """Let the caches hold ``positions`` in all (the prompt) without growing again.

        mlx-lm's ``KVCache`` grows by concatenating: the old and the new buffer live
        together, and each prefill chunk past the allocation would copy the sequence
        once more. Reserved, its first growth allocates the whole prompt, and later
        ones ``GROWTH_STEP`` positions.
        """
        assert isinstance(state, PlainState)
        state.reserved = positions

    def _size_growth(self, state: PlainState) -> None:
        for cache in state.cache:
            if type(cache) is KVCache:
                cache.step = max(GROWTH_STEP, state.reserved - cache.offset)

    def prefill(self, state: ModelState, tokens: list[int]) -> None:
        assert isinstance(state, PlainState)
        self._size_growth(state)
        # The logits are never evaluated: the graph of the cache states leaves out the
        # head (and the last layer's MLP), so prefill computes no [tokens, vocab] array.
        self.model(mx.array(tokens)[None], cache=state.cache)
        mx.eval([c.state for c in state.cache])

    def step(self, state: ModelState, tokens: mx.array) -> mx.array:
        assert isinstance(state, PlainState)
        self._size_growth(state)
        logits: mx.array = self.model(tokens[None], cache=state.cache)
        return logits[0, -1]

    def snapshot(self, state: ModelState) -> PlainState:
        """A copy; mlx-lm KV caches are copied at their length, not their allocation
        (which grows in steps), so a stored prefix costs what it holds."""
        assert isinstance(state, PlainState)
        copy = PlainState([_compact_copy(cache) for cache in state.cache])
        # Evaluated now: a lazy copy would keep the source's buffers alive (and stop
        # the source's next in-place update, which then copies instead).
        mx.eval([c.state for c in copy.cache])
        return copy

    def trimmed(self, state: ModelState, keep: int) -> PlainState | None:
        """`snapshot` of the first ``keep`` positions: plain KV caches copied at that
        length (not the entry's: a short shared start of a long entry holds only
        itself), other caches copied and trimmed (mlx-lm's ``trim``); None where a
        cache cannot drop the rest exactly."""
        assert isinstance(state, PlainState)
        if keep > state.offset or not can_trim_prompt_cache(state.cache):
            return None
        caches = []
        for cache in state.cache:
            kept = _compact_copy(cache, keep)
            offset = getattr(kept, "offset", None)
            if not isinstance(offset, int) or offset < keep:
                return None  # a cache without one position count (a list of caches)
            drop = offset - keep
            try:
                dropped = kept.trim(drop) if drop > 0 else 0
            except ValueError:  # caches that trim only within a margin (DeepSeek-V4's)
                return None
            if dropped != drop:
                return None
            caches.append(kept)
        trimmed = PlainState(caches)
        mx.eval([c.state for c in trimmed.cache])  # as `snapshot`: not the source's buffers
        return trimmed

    def compact(self, state: ModelState) -> None:
        assert isinstance(state, PlainState)
        state.cache = [_compacted(c) for c in state.cache]

    def nbytes(self, state: ModelState) -> int:
        assert isinstance(state, PlainState)
        return sum(int(getattr(c, "nbytes", 0)) for c in state.cache)
