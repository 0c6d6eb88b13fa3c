"""Decode batches whose state lives across steps.

A batch is created when sequences start decoding together; a sequence joins it
(its prefilled state inserted) and leaves it (filtered out) between steps, and a
step runs one forward for every row without copying the batch. Two forms:

* ``CacheBatch``: mlx-lm's batched caches (``BatchKVCache`` and friends, what its
  ``BatchGenerator`` keeps). Joining ``extend``s them, leaving ``filter``s them:
  a copy per change of membership, none per step. Rows are left-padded to the
  longest, so the runner starts another batch rather than pad a short row to a
  long context (``fits``).
* ``RowBatch``: models whose per-layer caches batch as rows (DeepSeek-V4: each
  row's sliding window, compressors and indexer advance at that row's own
  position; ``LayerCache.rows``). Joining and leaving are list operations and a
  row's state is always its own single-sequence state; no padding.
  ``MTPRowBatch`` also keeps each row's MTP cache and carried streams current,
  so a row can leave the batch and speculate on its own again.
"""

from typing import Any, Protocol

import mlx.core as mx
from mlx.nn.layers.base import Module

from mlxserve.engine.adapter import ModelAdapter, ModelState, PlainAdapter, PlainState
from mlxserve.engine.mtp_adapter import MTPAdapter

#: past this padded/real size ratio a row starts another batch (see ``CacheBatch.fits``)
MAX_PADDING_RATIO = 1.5
#: ... unless the padded batch is this short: then padding costs less than a second forward
FREE_PADDED_LENGTH = 1024


class DecodeBatch(Protocol):
    """Sequences decoding one token per step in one forward."""

    def __len__(self) -> int: ...

    def fits(self, state: ModelState) -> bool:
        """Whether ``state`` may join without making the batch wasteful."""

    def join(self, states: list[ModelState]) -> None:
        """Append rows, in order."""

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows (non-empty, ascending), in order."""

    def row_state(self, index: int) -> ModelState:
        """Row ``index`` as a single-sequence state of the adapter (a copy or the row)."""

    def step(self, tokens: mx.array) -> mx.array:
        """Add one token per row (``tokens`` [B]); return the logits [B, vocab], lazily."""

    def side_effects(self) -> list[Any]:
        """Arrays the step updated that its logits do not depend on (evaluate with them)."""


class CacheBatch:
    """Rows of mlx-lm caches that ``merge`` into a batched form (``BatchKVCache``...)."""

    def __init__(self, model: Module, states: list[PlainState]) -> None:
        self.model = model
        self.cache = self._merge(states)
        self.lengths = [state.offset for state in states]

    @staticmethod
    def _merge(states: list[PlainState]) -> list[Any]:
        layers = zip(*(state.cache for state in states), strict=True)
        return [layer[0].merge(list(layer)) for layer in layers]

    def __len__(self) -> int:
        return len(self.lengths)

    def fits(self, state: ModelState) -> bool:
        longest = max(*self.lengths, state.offset)
        padded = longest * (len(self.lengths) + 1)
        real = sum(self.lengths) + state.offset
        return longest <= FREE_PADDED_LENGTH or padded <= MAX_PADDING_RATIO * max(real, 1)

    def join(self, states: list[ModelState]) -> None:
        plain = [s for s in states if isinstance(s, PlainState)]
        assert len(plain) == len(states)
        for mine, theirs in zip(self.cache, self._merge(plain), strict=True):
            mine.extend(theirs)
        self.lengths += [state.offset for state in plain]

    def keep(self, indices: list[int]) -> None:
        rows = mx.array(indices)
        for cache in self.cache:
            cache.filter(rows)
        self.lengths = [self.lengths[i] for i in indices]

    def row_state(self, index: int) -> PlainState:
        return PlainState([cache.extract(index) for cache in self.cache])

    def step(self, tokens: mx.array) -> mx.array:
        logits: mx.array = self.model(tokens[:, None], cache=self.cache)
        self.lengths = [length + 1 for length in self.lengths]
        return logits[:, -1]

    def side_effects(self) -> list[Any]:
        return []


class RowBatch:
    """Rows whose per-layer caches batch as rows (``cache.rows``): DeepSeek-V4."""

    def __init__(self, model: Any, states: list[Any]) -> None:
        self.model = model
        self.states = list(states)

    def __len__(self) -> int:
        return len(self.states)

    def fits(self, state: ModelState) -> bool:
        return True  # no padding

    def join(self, states: list[ModelState]) -> None:
        self.states += states

    def keep(self, indices: list[int]) -> None:
        self.states = [self.states[i] for i in indices]

    def row_state(self, index: int) -> Any:
        return self.states[index]

    def layer_rows(self, caches: list[list[Any]]) -> list[Any]:
        return [layer[0].rows(list(layer)) for layer in zip(*caches, strict=True)]

    def step(self, tokens: mx.array) -> mx.array:
        cache = self.layer_rows([state.cache for state in self.states])
        logits: mx.array = self.model(tokens[:, None], cache=cache)
        return logits[:, -1]

    def side_effects(self) -> list[Any]:
        return []


class MTPRowBatch(RowBatch):
    """``RowBatch`` for ``MTPAdapter`` states (main cache, MTP caches, carried streams).

    Keeps the state invariant of ``mtp_adapter`` for every row: after a step the MTP
    cache holds the entry of the previous last position (built from its carried
    streams and the token just added), and the carry is the new last position's
    streams. The same work ``MTPAdapter.step`` does for one sequence.
    """

    def step(self, tokens: mx.array) -> mx.array:
        states = self.states
        streams = self.model.forward_hidden(
            tokens[:, None], self.layer_rows([s.cache for s in states])
        )
        history = mx.concatenate([s.carry for s in states], axis=0)
        mtp_cache = self.layer_rows([s.mtp_cache[:1] for s in states])[0]
        self.model.mtp_forward(history, tokens[:, None], mtp_cache, 0)
        for index, state in enumerate(states):
            state.carry = streams[index : index + 1, -1:]
        logits: mx.array = self.model.head_from_streams(streams[:, -1:])
        return logits[:, -1]

    def side_effects(self) -> list[Any]:
        # Nothing reads the MTP cache while rows decode plainly: evaluate it each step
        # so its lazy graph does not grow.
        return [[c.state for c in s.mtp_cache[:1]] for s in self.states]


def new_batch(adapter: ModelAdapter, states: list[ModelState]) -> DecodeBatch | None:
    """A batch of ``states`` when the adapter's model and caches allow one, else None."""
    model = getattr(adapter, "model", None)
    if model is None or not states:
        return None
    if isinstance(adapter, MTPAdapter):
        ok = all(
            getattr(s, "carry", None) is not None
            and _rows_capable(s.cache)  # type: ignore[attr-defined]
            and _rows_capable(s.mtp_cache[:1])  # type: ignore[attr-defined]
            and len(s.mtp_cache) > 0  # type: ignore[attr-defined]
            for s in states
        )
        return MTPRowBatch(model, states) if ok else None
    if not isinstance(adapter, PlainAdapter):
        return None
    plain = [s for s in states if isinstance(s, PlainState)]
    if len(plain) != len(states) or not plain[0].cache:
        return None
    if all(_rows_capable(s.cache) for s in plain):
        return RowBatch(model, plain)
    if all(callable(getattr(c, "merge", None)) for s in plain for c in s.cache):
        return CacheBatch(model, plain)
    return None


def can_join(batch: DecodeBatch, state: ModelState) -> bool:
    """Whether ``state`` is of the batch's form (else it needs its own batch or none)."""
    if isinstance(batch, MTPRowBatch):
        return getattr(state, "carry", None) is not None and _rows_capable(
            getattr(state, "cache", [])
        )
    if isinstance(batch, RowBatch):
        return isinstance(state, PlainState) and _rows_capable(state.cache)
    if isinstance(batch, CacheBatch):
        return isinstance(state, PlainState) and all(
            callable(getattr(c, "merge", None)) for c in state.cache
        )
    return False


def _rows_capable(caches: list[Any]) -> bool:
    return bool(caches) and all(callable(getattr(c, "rows", None)) for c in caches)
