"""Keys and values of a decode batch in preallocated rings: rows join and leave in place.

mlx-lm's ``BatchKVCache`` keeps the batch left-padded to a shared write column:
a row joining (``extend``), a row leaving (``filter``) and the batch growing past
its allocation each build a new array of the whole batch while the old one is
still alive, so memory briefly holds the batch twice. Here every layer keeps
one buffer ``[rows, heads, columns, dim]``, allocated for the rows' final
lengths, and every row writes its next position at the same column ``write``,
which advances around the buffer as a ring. A row's positions are the
``length`` columns just before ``write`` (wrapping around); the mask hides every
other column. So:

* a joining row's positions are written into a free row (in place);
* a leaving row's slot is filled by moving the rows after it down, one row at
  a time (in place; the order of the rows is the runner's);
* columns never run out while every row's final length fits in the ring, since
  a row only ever overwrites columns it no longer needs: the runner tells a
  joining row's room (its remaining ``max_tokens``), and the ring is sized for
  it. Only a batch outgrowing its rows or columns is copied, into a larger
  buffer, one layer at a time (so the copy holds one layer twice, not the batch).

Keys are stored rotated (RoPE at the row's own position, ``offset``), so a row's
columns need not be in order: attention weighs its positions the same wherever
they sit. One token per row per step (plain batched decoding).
"""

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

#: a batch's rows and columns grow to multiples of these
COLUMN_STEP = 32


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class RingKVCache:
    """One attention layer's keys and values for the rows of a decode batch.

    The mlx-lm cache interface the attention layers use: ``offset`` (each row's
    position, for RoPE), ``make_mask`` and ``update_and_fetch``. ``rows`` live rows
    occupy the first slots of ``keys`` / ``values``; ``lengths`` are their positions
    so far, ending at column ``write`` (exclusive, around the ring).
    """

    def __init__(self, keys: mx.array, values: mx.array) -> None:
        self.keys = keys
        self.values = values
        self.lengths: list[int] = []
        self.write = 0
        self.offset = mx.array([], dtype=mx.int32)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def columns(self) -> int:
        return int(self.keys.shape[2])

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes) + int(self.values.nbytes)

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    def is_trimmable(self) -> bool:
        return False

    def _set_offset(self) -> None:
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array:
        """Each row sees its own positions and the one it adds (``[rows, 1, 1, columns]``)."""
        if N != 1 or window_size is not None:
            raise ValueError("a ring batch adds one token per row, without a window")
        columns = mx.arange(self.columns, dtype=mx.int32)
        # Steps back from the column written now (0) to each column, around the ring.
        back = (self.write + self.columns - columns) % self.columns
        mask = back[None, :] <= self.offset[:, None]
        return mask[:, None, None, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[0] != self.rows or keys.shape[2] != 1:
            raise ValueError("a ring batch adds one token per row")
        column = self.write
        if self.rows == self.capacity:
            self.keys[:, :, column : column + 1, :] = keys
            self.values[:, :, column : column + 1, :] = values
        else:
            self.keys[: self.rows, :, column : column + 1, :] = keys
            self.values[: self.rows, :, column : column + 1, :] = values
        self.write = (column + 1) % self.columns
        self.lengths = [length + 1 for length in self.lengths]
        self.offset = self.offset + 1
        if self.rows == self.capacity:
            return self.keys, self.values
        return self.keys[: self.rows], self.values[: self.rows]

    # -- membership (between steps) -------------------------------------------

    def _place(self, slot: int, cache: KVCache) -> None:
        """Write a single-sequence cache's positions into ``slot``, ending at ``write``."""
        length = int(cache.offset)
        keys, values = cache.keys, cache.values
        if length == 0 or keys is None or values is None:
            return
        start = self.write - length
        if start >= 0:
            self.keys[slot : slot + 1, :, start : self.write, :] = keys[..., :length, :]
            self.values[slot : slot + 1, :, start : self.write, :] = values[..., :length, :]
            return
        # It wraps: the oldest positions go to the end of the ring.
        tail = -start
        self.keys[slot : slot + 1, :, self.columns - tail :, :] = keys[..., :tail, :]
        self.values[slot : slot + 1, :, self.columns - tail :, :] = values[..., :tail, :]
        self.keys[slot : slot + 1, :, : self.write, :] = keys[..., tail:length, :]
        self.values[slot : slot + 1, :, : self.write, :] = values[..., tail:length, :]

    def _move(self, source: int, target: int) -> None:
        """Copy row ``source`` over row ``target``: the row is copied out first (evaluated,
        so nothing else shares the ring's buffer), then written in place."""
        keys = self.keys[source : source + 1] * 1
        values = self.values[source : source + 1] * 1
        mx.eval(keys, values)
        self.keys[target : target + 1] = keys
        self.values[target : target + 1] = values

    def _resized(self, capacity: int, columns: int) -> None:
        """Copy into a larger buffer, the ring unrolled so ``write`` is the old column count."""
        old = self.columns
        shape = (capacity, self.keys.shape[1], columns)
        keys = mx.zeros((*shape, self.keys.shape[3]), self.keys.dtype)
        values = mx.zeros((*shape, self.values.shape[3]), self.values.dtype)
        rows, write = self.capacity, self.write
        keys[:rows, :, : old - write, :] = self.keys[..., write:, :]
        values[:rows, :, : old - write, :] = self.values[..., write:, :]
        if write:
            keys[:rows, :, old - write : old, :] = self.keys[..., :write, :]
            values[:rows, :, old - write : old, :] = self.values[..., :write, :]
        self.keys, self.values = keys, values
        self.write = old % columns


def _layer_of(cache: KVCache, capacity: int, columns: int) -> RingKVCache:
    keys, values = cache.keys, cache.values
    assert keys is not None and values is not None
    shape = (capacity, keys.shape[1], columns)
    return RingKVCache(
        mx.zeros((*shape, keys.shape[3]), keys.dtype),
        mx.zeros((*shape, values.shape[3]), values.dtype),
    )


def ring_capable(caches: list[Any]) -> bool:
    """Plain full-attention KV caches with content (mlx-lm's ``KVCache`` itself)."""
    return bool(caches) and all(type(c) is KVCache and c.keys is not None for c in caches)


def _need(state_caches: list[KVCache], room: int | None, max_reserve: int) -> int:
    """Columns a row needs: its positions and those it may still add (capped)."""
    reserve = max_reserve if room is None else min(max(room, 1), max_reserve)
    return int(state_caches[0].offset) + reserve


class RingBatch:
    """The ring caches of every layer, with the operations that change membership.

    ``max_reserve``: the positions a joining row reserves ahead at most (its remaining
    tokens, when fewer; the tuning's ``batch_reserve_positions``); a row decoding past
    them makes the ring grow (a copy, one layer at a time)."""

    def __init__(
        self,
        states: list[list[KVCache]],
        rooms: list[int | None],
        expected: int = 0,
        *,
        max_reserve: int,
    ) -> None:
        self.max_reserve = max_reserve
        capacity = max(len(states), expected)
        need = max(_need(s, r, max_reserve) for s, r in zip(states, rooms, strict=True))
        self.layers = [
            _layer_of(cache, capacity, _round_up(need, COLUMN_STEP)) for cache in states[0]
        ]
        mx.eval([layer.state for layer in self.layers])
        self.join(states, rooms)

    @property
    def lengths(self) -> list[int]:
        return list(self.layers[0].lengths)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def _grow(self, rows: int, need: int, expected: int = 0) -> None:
        first = self.layers[0]
        capacity, columns = first.capacity, first.columns
        if rows > capacity:
            # The requests running bound the rows (doubling could pass max_running).
            capacity = max(rows, expected) if expected else max(rows, 2 * capacity)
        if need > columns:
            columns = _round_up(need, COLUMN_STEP)
        if (capacity, columns) == (first.capacity, first.columns):
            return
        for layer in self.layers:
            layer._resized(capacity, columns)
            mx.eval(layer.state)  # one layer at a time: the old one goes before the next

    def join(self, states: list[list[KVCache]], rooms: list[int | None], expected: int = 0) -> None:
        """Add rows (``rooms``: the positions each may still add; ``expected``: the rows
        the batch may soon hold, allocated at once if it must grow)."""
        # A step still running holds the buffers; in-place writes wait for it (else
        # MLX would copy the buffer rather than write into one in use).
        mx.synchronize()
        need = max(_need(s, r, self.max_reserve) for s, r in zip(states, rooms, strict=True))
        # Every live row's positions must stay clear of the columns written next.
        need = max(need, max(self.layers[0].lengths, default=0) + 1)
        self._grow(self.layers[0].rows + len(states), need, expected)
        for state in states:
            for layer, cache in zip(self.layers, state, strict=True):
                layer._place(layer.rows, cache)
                layer.lengths.append(int(cache.offset))
                layer._set_offset()
            mx.eval([layer.state for layer in self.layers])

    def keep(self, indices: list[int]) -> None:
        mx.synchronize()
        for target, source in enumerate(indices):
            if source != target:
                for layer in self.layers:
                    layer._move(source, target)
                mx.eval([layer.state for layer in self.layers])
        for layer in self.layers:
            layer.lengths = [layer.lengths[i] for i in indices]
            layer._set_offset()

    def ensure_room(self) -> None:
        """Before a step: every row's next position must not overwrite its oldest."""
        longest = max(self.layers[0].lengths, default=0)
        if longest + 1 > self.layers[0].columns:
            self._grow(self.layers[0].rows, longest + self.max_reserve)

    def extract(self, index: int) -> list[KVCache]:
        """Row ``index`` as single-sequence caches, its positions in order (a copy)."""
        out = []
        for layer in self.layers:
            length, write, columns = layer.lengths[index], layer.write, layer.columns
            start = write - length
            row_k, row_v = layer.keys[index : index + 1], layer.values[index : index + 1]
            if start >= 0:
                keys = mx.contiguous(row_k[..., start:write, :])
                values = mx.contiguous(row_v[..., start:write, :])
            else:
                keys = mx.concatenate([row_k[..., columns + start :, :], row_k[..., :write, :]], 2)
                values = mx.concatenate(
                    [row_v[..., columns + start :, :], row_v[..., :write, :]], axis=2
                )
            cache = KVCache()  # type: ignore[no-untyped-call]
            cache.keys, cache.values, cache.offset = keys, values, length
            out.append(cache)
        return out
