"""Per-layer decoding cache for DeepSeek-V4.

Each layer keeps three kinds of state:

* ``window``: the normalised, rotated K=V rows of the last ``sliding_window - 1``
  positions (plus the rollback margin), all a new query can see of the raw sequence.
* per compressor (``"compressor"`` and, in CSA layers, ``"indexer"``) a
  ``CompressorState``: the compressed entries emitted so far and the *projected*
  ``(kv, gate)`` rows of the positions not yet folded into a closed entry. CSA
  compressors overlap each window with the previous one, so they also keep the rows of
  the last closed window; this replaces the reference's separate buffer and overlap
  tensors with one array of raw rows.

Rollback (for speculative decoding / MTP): ``make_cache(max_rollback=k)`` keeps ``k``
extra window rows and raw compressor rows, so ``trim(n)`` for ``n <= k`` can drop the
last ``n`` positions exactly: the window loses its last ``n`` rows, each compressor
drops the entries whose window is no longer complete, and the kept raw rows let the
next call re-emit them. ``is_trimmable()`` is true only with a margin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from mlxserve.kernels.buffers import own_buffers

if TYPE_CHECKING:
    from .stacked import StackedRows


def _append(cached: mx.array | None, new: mx.array) -> mx.array:
    return new if cached is None else mx.concatenate([cached, new], axis=1)


class CompressorState:
    """Entries of one compressor and the raw rows it still needs.

    ``raw_kv`` / ``raw_gate`` ([B, R, width]) hold positions ``raw_start`` up to the
    layer offset; ``entries`` ([B, N, head_dim]) hold windows ``0 .. N-1``.
    """

    def __init__(self, ratio: int, overlap: bool) -> None:
        self.ratio = ratio
        self.overlap = overlap
        self.raw_kv: mx.array | None = None
        self.raw_gate: mx.array | None = None
        self.raw_start = 0
        self.entries: mx.array | None = None

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else int(self.entries.shape[1])

    def append_raw(self, kv: mx.array, gate: mx.array) -> None:
        self.raw_kv = _append(self.raw_kv, kv)
        self.raw_gate = _append(self.raw_gate, gate)

    def raw_rows(self, start: int, stop: int) -> tuple[mx.array, mx.array]:
        """The raw rows of absolute positions ``[start, stop)``."""
        assert self.raw_kv is not None and self.raw_gate is not None
        if start < self.raw_start:
            raise RuntimeError("Compressor rows needed for this step were already dropped.")
        lo, hi = start - self.raw_start, stop - self.raw_start
        return self.raw_kv[:, lo:hi], self.raw_gate[:, lo:hi]

    def append_entries(self, entries: mx.array) -> None:
        self.entries = _append(self.entries, entries)

    def first_needed(self, offset: int) -> int:
        """The first raw position the next step may read, if ``offset`` tokens are done."""
        closed = offset // self.ratio
        return max(closed - (1 if self.overlap else 0), 0) * self.ratio

    def drop_raw_before(self, position: int) -> None:
        if self.raw_kv is None or self.raw_gate is None or position <= self.raw_start:
            return
        cut = position - self.raw_start
        self.raw_kv = self.raw_kv[:, cut:]
        self.raw_gate = self.raw_gate[:, cut:]
        self.raw_start = position

    def trim_to(self, offset: int) -> None:
        """Forget everything from position ``offset`` on."""
        keep = offset // self.ratio
        if self.entries is not None:
            self.entries = self.entries[:, :keep]
        if self.raw_kv is not None and self.raw_gate is not None:
            self.raw_kv = self.raw_kv[:, : offset - self.raw_start]
            self.raw_gate = self.raw_gate[:, : offset - self.raw_start]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.raw_kv, self.raw_gate, self.entries) if a is not None]


class LayerCache(_BaseCache):
    """Cache of one decoder layer (see the module docstring)."""

    def __init__(
        self,
        sliding_window: int,
        compressors: dict[str, CompressorState] | None = None,
        max_rollback: int = 0,
    ) -> None:
        self.sliding_window = sliding_window
        self.max_rollback = max_rollback
        self.compressors = compressors or {}
        self.offset = 0
        self.window: mx.array | None = None

    def update_window(self, kv: mx.array, extra: mx.array | None = None) -> mx.array:
        """Return the kept rows followed by ``kv``, and keep the rows a later query needs.

        ``extra`` rows (a decode step's compressed entries) are returned after ``kv``,
        not kept: the step's keys are then one concatenation, not two."""
        if extra is None:
            window = _append(self.window, kv)
            joined = window
        else:
            joined = mx.concatenate([a for a in (self.window, kv, extra) if a is not None], axis=1)
            window = joined[:, : joined.shape[1] - extra.shape[1]]
        keep = self.sliding_window - 1 + self.max_rollback
        self.window = window[:, -keep:] if keep > 0 else window[:, :0]
        return joined

    def advance(self, length: int) -> None:
        """Close a step of ``length`` tokens, dropping the raw rows no longer needed."""
        self.offset += length
        floor = max(self.offset - self.max_rollback, 0)
        for state in self.compressors.values():
            state.drop_raw_before(state.first_needed(floor))

    @property
    def state(self) -> list[mx.array]:
        arrays = [] if self.window is None else [self.window]
        for compressor in self.compressors.values():
            arrays.extend(compressor.arrays())
        return arrays

    @state.setter
    def state(self, value: list[mx.array]) -> None:
        raise NotImplementedError("Restoring a DeepSeek-V4 layer cache is not supported yet.")

    def compact(self) -> None:
        """Give the window and the compressors' arrays buffers of their own size, copied
        together: the window is a slice of the step's concatenation, and a slice keeps
        its source's whole buffer alive (see ``mlxserve.kernels.buffers``)."""
        copies = iter(own_buffers(self.state))  # the window, then each compressor's arrays
        if self.window is not None:
            self.window = next(copies)
        for state in self.compressors.values():
            state.raw_kv, state.raw_gate, state.entries = (
                None if a is None else next(copies)
                for a in (state.raw_kv, state.raw_gate, state.entries)
            )

    def is_trimmable(self) -> bool:
        return self.max_rollback > 0

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions exactly and return ``n``.

        Raises ``ValueError`` when fewer than ``n`` can be dropped (beyond the rollback
        margin, or more than the cache holds): a silent partial trim would leave
        rejected draft positions in the cache and corrupt every later step. The trim
        only slices the kept arrays; nothing is copied.
        """
        if n <= 0:
            return 0
        possible = min(self.offset, self._trimmable())
        if n > possible:
            raise ValueError(
                f"cannot trim {n} positions: at most {possible} can be dropped exactly "
                f"(offset {self.offset}, rollback margin {self.max_rollback})"
            )
        new_offset = self.offset - n
        if self.window is not None:
            self.window = self.window[:, : self.window.shape[1] - n]
        for compressor in self.compressors.values():
            compressor.trim_to(new_offset)
        self.offset = new_offset
        return n

    def _trimmable(self) -> int:
        """The most positions ``trim`` can drop and still decode exactly afterwards."""
        best = 0
        rows = 0 if self.window is None else int(self.window.shape[1])
        for n in range(1, min(self.max_rollback, self.offset) + 1):
            new_offset = self.offset - n
            if rows - n < min(self.sliding_window - 1, new_offset):
                break
            if any(c.raw_start > c.first_needed(new_offset) for c in self.compressors.values()):
                break
            best = n
        return best

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.state)

    @classmethod
    def rows(cls, caches: list[LayerCache]) -> RowCaches:
        """Several sequences' caches of this layer, for one batched forward."""
        return RowCaches(caches)

    @classmethod
    def can_stack(cls, caches: list[LayerCache]) -> bool:
        """Whether ``stack`` takes these caches (decoding rows of one layer kind)."""
        from .stacked import StackedRows  # stacked.py builds on this module

        return StackedRows.can_stack(caches)

    @classmethod
    def stack(cls, caches: list[LayerCache]) -> StackedRows:
        """Several decoding sequences' caches of this layer stacked for one-token steps
        (``stacked.py``); they hold nothing of their own until written back."""
        from .stacked import StackedRows

        if not StackedRows.can_stack(caches):
            raise ValueError("these caches do not stack (a row without a window?)")
        return StackedRows(caches)


class RowCaches:
    """The caches of one layer for a batch of sequences, each at its own offset.

    A DeepSeek-V4 layer's state is per sequence in a way a padded tensor does not fit:
    compressors close a window every ``ratio`` positions *of that sequence*, and the
    window, the entries and the indexer's picks all depend on the row's own position.
    So each row keeps its own ``LayerCache``; the attention runs the cache-dependent
    part row by row and everything else (projections, MoE, head) once for the batch.
    Rows join and leave a batch by list operations: no cache is copied. This is the
    form for several tokens per row (speculative verify); one-token decode steps
    stack the rows instead (``LayerCache.stack``), which pads and masks them so the
    core runs once for the batch.
    """

    def __init__(self, rows: list[LayerCache]) -> None:
        self.rows = rows

    @property
    def offsets(self) -> list[int]:
        return [row.offset for row in self.rows]
