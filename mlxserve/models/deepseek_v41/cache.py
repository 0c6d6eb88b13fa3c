"""One DeepSeek-V4.1 layer's cache, which can drop its last positions exactly.

Why: speculative decoding verifies drafted tokens in one forward and then forgets the
rejected ones. mlx-lm's ``deepseek_v41.LayerCache`` cannot (``is_trimmable`` is
false): its sliding window keeps only ``sliding_window`` rows, and a compressor folds
the raw rows of a closed group into one entry and keeps none of them. This cache is
mlx-lm's, plus, with ``max_rollback = k``:

* ``k`` more window rows, so dropping up to ``k`` positions leaves every row a later
  query reads (mlx-lm's ``_window_indices`` picks the last ``sliding_window`` of any
  number of held rows);
* on a KV-source layer (``ratio`` > 0), the projected ``(kv, gate)`` rows of the last
  ``ratio - 1 + k`` positions (``remember_raw``, called by ``compressor.Compressor``),
  so a trim that reopens a closed group rebuilds its pending rows; its entries (and
  index keys) are cut to the groups still complete;
* the sequence's last mapped token ids for Engram hashing (``engram_history``, kept in
  the first layer's cache), ``k`` more than the n-grams need.

``trim(n)`` for ``n <= k`` only slices; nothing is recomputed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as text

from mlxserve.kernels.buffers import own_buffers


def _append(cached: mx.array | None, new: mx.array) -> mx.array:
    return new if cached is None else mx.concatenate([cached, new], axis=1)


def _last(array: mx.array, rows: int) -> mx.array:
    return array[:, array.shape[1] - rows :] if array.shape[1] > rows else array


class LayerCache(text.LayerCache):
    """mlx-lm's V4.1 layer cache with a rollback margin (see the module docstring)."""

    def __init__(self, window_size: int, max_rollback: int = 0, ratio: int = 0) -> None:
        super().__init__(window_size)
        self.max_rollback = max_rollback
        #: the compression ratio of this layer's own compressor (0: it has none)
        self.ratio = ratio
        self.raw_kv: mx.array | None = None
        self.raw_gate: mx.array | None = None
        #: mapped token ids for Engram hashing (first layer only), see ``remember_ids``
        self.engram_history: mx.array | None = None

    @property
    def _fields(self) -> Any:
        """This cache with mlx-lm's fields writable to the type checker (mlx-lm
        initialises them to None and so types them so)."""
        return self

    def update_window(self, kv: mx.array) -> mx.array:
        window = _append(self.window, kv)
        self._fields.window = _last(window, self.window_size + self.max_rollback)
        self.offset += kv.shape[1]
        return window

    def remember_raw(self, kv: mx.array, gate: mx.array) -> None:
        """The compressor's projected rows of the positions just added (before
        ``update_window`` counts them: the compressor runs after it)."""
        if not self.max_rollback:
            return
        keep = self.ratio - 1 + self.max_rollback
        self.raw_kv = _last(_append(self.raw_kv, kv), keep)
        self.raw_gate = _last(_append(self.raw_gate, gate), keep)

    def remember_ids(self, mapped: mx.array, needed: int) -> mx.array | None:
        """Keep the last ``needed`` (plus the margin) mapped ids after ``mapped``; return
        the history before them (what the hasher reads)."""
        before = self.engram_history
        self.engram_history = _last(_append(before, mapped), needed + self.max_rollback)
        return before

    @property
    def arrays(self) -> list[mx.array]:
        held = (
            self.window,
            self.compress_kv,
            self.index_k,
            self.pending_kv,
            self.pending_gate,
            self.raw_kv,
            self.raw_gate,
            self.engram_history,
        )
        return [a for a in held if a is not None]

    @property
    def state(self) -> list[mx.array]:  # type: ignore[override]
        return self.arrays

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def is_trimmable(self) -> bool:
        return self.max_rollback > 0

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions exactly and return ``n``; ``ValueError`` when
        that is beyond the margin (a partial trim would keep rejected drafts)."""
        if n <= 0:
            return 0
        if n > min(self.max_rollback, self.offset):
            raise ValueError(
                f"cannot trim {n} positions: the margin is {self.max_rollback} "
                f"and the cache holds {self.offset}"
            )
        end = self.offset - n
        if self.window is not None:
            self._fields.window = self.window[:, : self.window.shape[1] - n]
        if self.engram_history is not None:
            self.engram_history = self.engram_history[:, : self.engram_history.shape[1] - n]
        if self.ratio:
            self._trim_compressed(end)
        self.offset = end
        return n

    def _trim_compressed(self, end: int) -> None:
        groups = end // self.ratio
        fields = self._fields
        if self.compress_kv is not None:
            fields.compress_kv = self.compress_kv[:, :groups]
        if self.index_k is not None:
            fields.index_k = self.index_k[:, :groups]
        if self.ratio == 1:
            return
        if self.raw_kv is None or self.raw_gate is None:
            raise ValueError("cannot trim: the compressor's rows were not kept")
        raw_start = self.offset - self.raw_kv.shape[1]
        first = groups * self.ratio
        if first < raw_start:
            raise ValueError("cannot trim: the compressor's rows were already dropped")
        fields.pending_kv = self.raw_kv[:, first - raw_start : end - raw_start]
        fields.pending_gate = self.raw_gate[:, first - raw_start : end - raw_start]
        self.raw_kv = self.raw_kv[:, : end - raw_start]
        self.raw_gate = self.raw_gate[:, : end - raw_start]

    def compact(self) -> None:
        """Every array in a buffer of its own size (before the prefix cache keeps it)."""
        names = (
            "window",
            "compress_kv",
            "index_k",
            "pending_kv",
            "pending_gate",
            "raw_kv",
            "raw_gate",
            "engram_history",
        )
        held = [name for name in names if getattr(self, name) is not None]
        for name, copy in zip(held, own_buffers(getattr(self, n) for n in held), strict=True):
            setattr(self, name, copy)
