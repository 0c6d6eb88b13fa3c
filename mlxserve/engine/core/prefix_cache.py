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
        for length, key, whole in self._covering(prompt):
            entry = self._entries[key]
            state = self.adapter.snapshot(entry.state) if whole else self._trimmed(entry, length)
            if state is not None:  # a start that cannot trim leaves the next its turn
                self.hits += 1
                self._entries.move_to_end(key)
                return state, length
        self.misses += 1
        return None

    def _covering(self, prompt: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], bool]]:
        """(tokens covered, key, whether the whole entry) of each entry that covers a
        start of ``prompt[:-1]``, the most first (a whole entry before a trimmed one of
        the same length: it needs no trim). A shared start counts only where the
        adapter trims and it reaches `MIN_SHARED_TOKENS`."""
        trims = (
            bool(self._entries)
            and isinstance(self.adapter, SupportsTrim)
            and len(prompt) > MIN_SHARED_TOKENS
        )
        wanted = np.asarray(prompt[:-1], dtype=np.int64) if trims else None
        found = []
        for key, entry in self._entries.items():
            if len(key) < len(prompt) and prompt[: len(key)] == key:
                found.append((len(key), key, True))
            elif wanted is not None:
                length = shared_length(entry.tokens, wanted)
                if MIN_SHARED_TOKENS <= length < len(key):
                    found.append((length, key, False))
        return sorted(found, key=lambda c: (-c[0], not c[2]))

    def _trimmed(self, entry: _Entry, length: int) -> ModelState | None:
        adapter = self.adapter
        assert isinstance(adapter, SupportsTrim)
        return adapter.trimmed(entry.state, length)

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
