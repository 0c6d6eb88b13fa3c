"""Prefix reuse: model states after a prompt, keyed by its tokens, LRU-bounded.

A state is stored after prefilling all prompt tokens but the last, so a
repeated prompt (or one that extends a cached prompt) only runs what is new.
Where the model's caches can drop their last positions (`SupportsTrim`: mlx-lm's
KV caches), an entry that shares only the start of a prompt serves that start
too: requests with one system prompt and different questions, or a conversation
whose last turn was edited, prefill only from where they differ. Bounded by entry
count and by bytes; the least recently used entry goes first.
"""

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mlxserve.engine.runner.adapter import ModelAdapter, ModelState, SupportsTrim

#: The fewest shared tokens worth a trimmed copy of an entry (a copy of the whole
#: entry, for fewer positions than that, costs more than it saves).
MIN_SHARED_TOKENS = 32


@dataclass
class _Entry:
    state: ModelState
    nbytes: int
    tokens: np.ndarray  # the key, as an array: shared starts are found without a loop


def shared_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    def __init__(self, adapter: ModelAdapter, max_entries: int, max_bytes: int) -> None:
        self.adapter = adapter
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (the hit and miss counts stay)."""
        self._entries.clear()
        self._bytes = 0

    def lookup(self, prompt: tuple[int, ...]) -> tuple[ModelState, int] | None:
        """A private copy of the cached state that covers the most of ``prompt[:-1]``:
        the longest entry that prefixes it, or, where states trim, an entry's shared
        start (at least `MIN_SHARED_TOKENS`) when that is longer."""
        best: tuple[int, ...] | None = None
        for tokens in self._entries:
            fits = len(tokens) < len(prompt) and prompt[: len(tokens)] == tokens
            if fits and (best is None or len(tokens) > len(best)):
                best = tokens
        shared = self._shared_start(prompt, 0 if best is None else len(best))
        if shared is not None:
            self.hits += 1
            return shared
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best)
        return self.adapter.snapshot(self._entries[best].state), len(best)

    def _shared_start(
        self, prompt: tuple[int, ...], longer_than: int
    ) -> tuple[ModelState, int] | None:
        """The trimmed copy of the entry sharing the longest start with ``prompt[:-1]``,
        if longer than ``longer_than`` and `MIN_SHARED_TOKENS`, and the adapter trims."""
        adapter = self.adapter
        if not isinstance(adapter, SupportsTrim) or len(prompt) <= MIN_SHARED_TOKENS:
            return None
        wanted = np.asarray(prompt[:-1], dtype=np.int64)
        floor = max(longer_than, MIN_SHARED_TOKENS - 1)
        candidates = []
        for key, entry in self._entries.items():
            length = shared_length(entry.tokens, wanted)
            if floor < length < len(key):
                candidates.append((length, key))
        # The longest first; one that cannot trim (a sliding window that wrapped)
        # leaves the next its turn.
        for length, key in sorted(candidates, key=lambda c: -c[0]):
            trimmed = adapter.trimmed(self._entries[key].state, length)
            if trimmed is not None:
                self._entries.move_to_end(key)
                return trimmed, length
        return None

    def store(self, tokens: tuple[int, ...], state: ModelState, owned: bool = False) -> None:
        """Keep a copy of ``state`` after ``tokens`` (``owned``: the state itself, which
        its caller gives up)."""
        if self.max_entries <= 0 or not tokens or tokens in self._entries:
            return
        # A state over the bound is not copied at all (its copy could still fit, but
        # making it would hold the state twice for nothing when it does not).
        if self.adapter.nbytes(state) > self.max_bytes:
            return
        kept = state if owned else self.adapter.snapshot(state)
        self.adapter.compact(kept)
        # Counted as kept: a copy holds the positions, not the source's allocation
        # (mlx-lm caches grow in steps); counting that overstated what is held.
        nbytes = self.adapter.nbytes(kept)
        self._entries[tokens] = _Entry(kept, nbytes, np.asarray(tokens, dtype=np.int64))
        self._bytes += nbytes
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
