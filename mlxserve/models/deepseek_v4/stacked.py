"""One layer's decoding state for a batch of rows, stacked, for one-token steps.

``RowCaches`` runs a layer's cache-dependent core row by row, which costs a few
kernel launches per row and layer: on a GPU a batch of small rows is then bound by
launches, not by work. ``StackedRows`` holds the same state as ``B`` rows' own
``LayerCache`` objects, in a few [B, ...] tensors, so a decode step (one token per
row) runs the core once for the whole batch:

* ``window`` [B, K, D]: each row's last ``K = sliding_window - 1 + max_rollback``
  K=V rows, right-aligned; a row shorter than ``K`` is left-padded and masked.
* per compressor a ``StackedCompressor``: the last ``span + max_rollback`` raw
  ``(kv, gate)`` rows of each row, right-aligned (``span``: the rows one entry pools,
  ``2 * ratio`` when windows overlap), the padding holding ``gate = -inf`` (the
  weight-0 slots the single-row pooling adds before window 0), and the entries
  [B, capacity, head_dim] with each row's count (entries past it are masked).

A row closes an entry when ``ratio`` divides its new length: its last ``span`` raw
rows are then exactly that entry's window, so the pooling of every row is one batched
computation (done only on steps where some row closes one) and a scatter writes each
row's entry at its own count.

The stacked state always holds everything a row's ``LayerCache`` would: ``unstack``
gives every row its own back as slices of the stacked tensors (no copy), before the
rows speculate (several tokens, rollback) in their single-sequence form, and the
batch stacks again at its next decode step. Membership changes keep the stack: a
joining row is stacked and appended (``extend``), a leaving one gets copies (so it
does not keep the batch's tensors alive) and the rest are gathered (``take``): one
copy per change of membership, none per step.
"""

from __future__ import annotations

import mlx.core as mx

from mlxserve.kernels.buffers import owned

from .cache import CompressorState, LayerCache

#: entries a stacked compressor's capacity grows by (each growth copies its entries)
ENTRY_STEP = 16


def _left_pad(
    rows: list[mx.array | None], length: int, width: int, dtype: mx.Dtype, fill: float
) -> mx.array:
    """[1, r, width] rows (or None: none yet), each left-padded with ``fill`` to ``length``."""
    padded = []
    for row in rows:
        kept = 0 if row is None else min(int(row.shape[1]), length)
        pad = mx.full((1, length - kept, width), fill, dtype=dtype)
        if kept:
            assert row is not None
            pad = mx.concatenate([pad, row[:, int(row.shape[1]) - kept :].astype(dtype)], axis=1)
        padded.append(pad)
    return mx.concatenate(padded, axis=0)


def _rows(array: mx.array | None) -> int:
    return 0 if array is None else int(array.shape[1])


def _slice(view: mx.array, own: bool) -> mx.array:
    """The view itself, or with ``own`` a copy that does not keep the stack alive once
    evaluated (`StackedRows.write_back` evaluates the row's copies together)."""
    return owned(view) if own else view


def entry_capacity(count: int) -> int:
    """The capacity that holds ``count`` entries plus the one a step may write."""
    return (count // ENTRY_STEP + 1) * ENTRY_STEP


class StackedCompressor:
    """``CompressorState`` of ``B`` rows (see the module docstring)."""

    def __init__(self, states: list[CompressorState], margin: int) -> None:
        first = states[0]
        assert first.raw_kv is not None and first.raw_gate is not None
        self.ratio, self.overlap, self.margin = first.ratio, first.overlap, margin
        self.span = self.ratio * (2 if self.overlap else 1)
        self.length = self.span + margin
        width = int(first.raw_kv.shape[-1])
        # A row keeps the raw rows from ``raw_start`` to its offset: right-aligned.
        kv = [s.raw_kv for s in states]
        self.raw_kv = _left_pad(kv, self.length, width, first.raw_kv.dtype, 0.0)
        gates = [s.raw_gate for s in states]
        self.raw_gate = _left_pad(gates, self.length, width, first.raw_gate.dtype, -mx.inf)
        self.counts = [s.num_entries for s in states]
        # A row that rolled back holds fewer raw rows than its offset allows; those
        # it lacks are padding, never written back as its own.
        self.raw_starts = [s.raw_start for s in states]
        self.entries: mx.array | None = None
        with_entries = [s.entries for s in states if s.entries is not None]
        if with_entries:
            entry = with_entries[0]
            cap = entry_capacity(max(self.counts))
            self.entries = mx.concatenate(
                [
                    mx.concatenate(
                        [
                            s.entries if s.entries is not None else entry[:, :0],
                            mx.zeros((1, cap - s.num_entries, entry.shape[-1]), entry.dtype),
                        ],
                        axis=1,
                    )
                    for s in states
                ]
            )

    @property
    def capacity(self) -> int:
        return 0 if self.entries is None else int(self.entries.shape[1])

    def push(self, kv: mx.array, gate: mx.array) -> None:
        """Append one raw row per row ([B, 1, width] each), dropping the oldest."""
        self.raw_kv = mx.concatenate([self.raw_kv[:, 1:], kv], axis=1)
        self.raw_gate = mx.concatenate([self.raw_gate[:, 1:], gate], axis=1)

    def window(self) -> tuple[mx.array, mx.array]:
        """Each row's last ``span`` raw rows: the window of the entry it may close now."""
        return self.raw_kv[:, -self.span :], self.raw_gate[:, -self.span :]

    def write(self, entry: mx.array, closing: list[bool]) -> None:
        """Put each row's pooled ``entry`` [B, 1, d] at its count; count the closing rows'.

        Rows that close nothing write a placeholder past their count, masked until their
        real entry overwrites it.
        """
        need = entry_capacity(max(self.counts))
        if self.entries is None:
            self.entries = mx.zeros((len(self.counts), need, entry.shape[-1]), entry.dtype)
        elif need > self.capacity:
            grow = mx.zeros((len(self.counts), need - self.capacity, entry.shape[-1]), entry.dtype)
            self.entries = mx.concatenate([self.entries, grow], axis=1)
        index = mx.array(self.counts, dtype=mx.int32)[:, None, None]
        index = mx.broadcast_to(index, entry.shape)
        self.entries = mx.put_along_axis(
            self.entries, index, entry.astype(self.entries.dtype), axis=1
        )
        self.counts = [c + int(close) for c, close in zip(self.counts, closing, strict=True)]

    def valid(self) -> mx.array:
        """[B, capacity] mask of each row's entries."""
        return mx.arange(self.capacity)[None, :] < mx.array(self.counts)[:, None]

    def write_back(self, row: int, state: CompressorState, offset: int, own: bool) -> None:
        """Give row ``row`` (now at ``offset``) its single-sequence state back: slices of
        the stacked tensors, or with ``own`` copies (which do not keep them alive)."""
        start = max(self.raw_starts[row], state.first_needed(max(offset - self.margin, 0)))
        kept = offset - start
        state.raw_kv = _slice(self.raw_kv[row : row + 1, self.length - kept :], own)
        state.raw_gate = _slice(self.raw_gate[row : row + 1, self.length - kept :], own)
        state.raw_start = start
        count = self.counts[row]
        state.entries = (
            None
            if self.entries is None or count == 0
            else _slice(self.entries[row : row + 1, :count], own)
        )

    def take(self, indices: list[int], rows: mx.array) -> None:
        """Keep the rows ``indices`` (``rows``: the same on the device), in that order."""
        self.raw_kv, self.raw_gate = self.raw_kv[rows], self.raw_gate[rows]
        self.raw_starts = [self.raw_starts[i] for i in indices]
        self.counts = [self.counts[i] for i in indices]
        if self.entries is not None:
            self.entries = self.entries[rows, : entry_capacity(max(self.counts))]

    def extend(self, other: StackedCompressor) -> None:
        """Append ``other``'s rows (same layer kind and margin)."""
        self.raw_kv = mx.concatenate([self.raw_kv, other.raw_kv])
        self.raw_gate = mx.concatenate([self.raw_gate, other.raw_gate])
        ours, theirs = self._padded(other), other._padded(self)
        self.counts = self.counts + other.counts
        self.raw_starts = self.raw_starts + other.raw_starts
        if ours is not None and theirs is not None:
            self.entries = mx.concatenate([ours, theirs])

    def _padded(self, other: StackedCompressor) -> mx.array | None:
        """This side's entries at the larger of the two capacities (zeros if none)."""
        sample = self.entries if self.entries is not None else other.entries
        if sample is None:
            return None
        capacity = max(self.capacity, other.capacity)
        rows, dim = len(self.counts), int(sample.shape[-1])
        if self.entries is None:
            return mx.zeros((rows, capacity, dim), sample.dtype)
        if capacity == self.capacity:
            return self.entries
        grow = mx.zeros((rows, capacity - self.capacity, dim), sample.dtype)
        return mx.concatenate([self.entries, grow], axis=1)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.raw_kv, self.raw_gate, self.entries) if a is not None]


class StackedRows:
    """One layer's caches of ``B`` rows, stacked for one-token steps (module docstring)."""

    def __init__(self, rows: list[LayerCache]) -> None:
        first = rows[0]
        self.rows = rows
        self.sliding_window = first.sliding_window
        self.max_rollback = first.max_rollback
        self.offsets = [row.offset for row in rows]
        self.keep = self.sliding_window - 1 + self.max_rollback
        # The window rows each row holds (fewer than it may after a rollback).
        self.held = [min(_rows(row.window), self.keep) for row in rows]
        sample = next(row.window for row in rows if row.window is not None)
        self.window = _left_pad(
            [row.window for row in rows], self.keep, int(sample.shape[-1]), sample.dtype, 0.0
        )
        self.compressors = {
            name: StackedCompressor([row.compressors[name] for row in rows], self.max_rollback)
            for name in first.compressors
        }
        # Rows written back with copies of their own since the stack last changed:
        # a row leaving (`take`) needs no second copy.
        self._owned: set[int] = set()
        for row in rows:  # stale while stacked: do not hold the state twice
            row.window = None
            for state in row.compressors.values():
                state.raw_kv = state.raw_gate = state.entries = None

    @staticmethod
    def can_stack(rows: list[LayerCache]) -> bool:
        """Rows of one layer kind and margin, each with a window (decoding rows)."""
        first = rows[0]
        return all(
            row.offset > 0
            and row.window is not None
            and row.sliding_window == first.sliding_window
            and row.max_rollback == first.max_rollback
            and row.compressors.keys() == first.compressors.keys()
            and all(s.raw_kv is not None for s in row.compressors.values())
            for row in rows
        )

    def __len__(self) -> int:
        return len(self.rows)

    def update_window(self, kv: mx.array) -> tuple[mx.array, mx.array | None]:
        """Add each row's K=V row [B, 1, D]; return the keys a query sees [B, W, D] and
        their mask [B, W] (None when every row sees a full window)."""
        window = mx.concatenate([self.window, kv.astype(self.window.dtype)], axis=1)
        self.window = window[:, 1:]
        self._owned.clear()
        size = self.sliding_window
        keys = window[:, window.shape[1] - size :]
        if min(self.offsets) >= size - 1:
            return keys, None
        seen = mx.array([min(offset, size - 1) for offset in self.offsets])[:, None]
        return keys, mx.arange(size)[None, :] >= size - 1 - seen

    def advance(self) -> None:
        self.offsets = [offset + 1 for offset in self.offsets]
        self.held = [min(held + 1, self.keep) for held in self.held]
        self._owned.clear()

    def compatible(self, other: StackedRows) -> bool:
        """Whether ``other``'s rows can join these (same layer kind, margin, dtypes)."""
        return (
            (self.sliding_window, self.max_rollback, self.window.dtype)
            == (other.sliding_window, other.max_rollback, other.window.dtype)
            and self.compressors.keys() == other.compressors.keys()
            and all(
                (c.raw_kv.dtype, c.raw_gate.dtype, c.length)
                == (o.raw_kv.dtype, o.raw_gate.dtype, o.length)
                and (c.entries is None or o.entries is None or c.entries.dtype == o.entries.dtype)
                for c, o in zip(self.compressors.values(), other.compressors.values(), strict=True)
            )
        )

    def extend(self, other: StackedRows) -> None:
        """Append ``other``'s rows (``compatible``): one copy of each stacked tensor."""
        self.window = mx.concatenate([self.window, other.window])
        for name, stacked in self.compressors.items():
            stacked.extend(other.compressors[name])
        self.rows = self.rows + other.rows
        self.offsets = self.offsets + other.offsets
        self.held = self.held + other.held

    def take(self, indices: list[int]) -> None:
        """Keep these rows, in this order; the others get their own caches back (copies,
        so the stacked tensors are not kept alive by a row that left)."""
        kept = set(indices)
        for index in range(len(self.rows)):
            if index not in kept and index not in self._owned:
                self.write_back(index, own=True)
        self._owned.clear()
        rows = mx.array(indices)
        self.window = self.window[rows]
        for stacked in self.compressors.values():
            stacked.take(indices, rows)
        self.rows = [self.rows[i] for i in indices]
        self.offsets = [self.offsets[i] for i in indices]
        self.held = [self.held[i] for i in indices]

    def write_back(self, index: int, own: bool) -> None:
        """Row ``index``'s own ``LayerCache`` (slices, or with ``own`` copies) from the
        stacked state; the row stays stacked (the stack remains its state)."""
        row, offset, kept = self.rows[index], self.offsets[index], self.held[index]
        row.window = _slice(self.window[index : index + 1, self.keep - kept :], own)
        row.offset = offset
        for name, stacked in self.compressors.items():
            stacked.write_back(index, row.compressors[name], offset, own)
        if own:
            mx.eval(row.state)  # the copies, together: unevaluated, they hold the stack
            self._owned.add(index)

    def unstack(self) -> None:
        """Write every row's own ``LayerCache`` back (slices, no copy)."""
        for index in range(len(self.rows)):
            self.write_back(index, own=False)

    @property
    def state(self) -> list[mx.array]:
        """Every stacked tensor (to evaluate them, or count their bytes)."""
        return [self.window, *(a for c in self.compressors.values() for a in c.arrays())]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state)
