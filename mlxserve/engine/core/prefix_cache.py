"""Exact prefix reuse: model states after a prompt, keyed by its tokens, LRU-bounded.

A state is stored after prefilling all prompt tokens but the last, so a
repeated prompt (or one that extends a cached prompt) only runs what is new.
Bounded by entry count and by bytes; the least recently used entry goes first.
"""

from collections import OrderedDict
from dataclasses import dataclass

from mlxserve.engine.runner.adapter import ModelAdapter, ModelState


@dataclass
class _Entry:
    state: ModelState
    nbytes: int


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
        """A private copy of the longest cached state whose tokens prefix `prompt[:-1]`."""
        best: tuple[int, ...] | None = None
        for tokens in self._entries:
            fits = len(tokens) < len(prompt) and prompt[: len(tokens)] == tokens
            if fits and (best is None or len(tokens) > len(best)):
                best = tokens
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best)
        return self.adapter.snapshot(self._entries[best].state), len(best)

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
        self._entries[tokens] = _Entry(kept, nbytes)
        self._bytes += nbytes
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
