"""Learned token compressors of the CSA / HCA layers and of the CSA indexer.

Every ``ratio`` source tokens become one entry: a softmax over the window (per
channel, with a learned position bias ``ape``) pools the projected ``wkv`` rows, then
an RMSNorm and RoPE at the window's first position follow.

* HCA (and any non-overlapping compressor): the softmax spans the ``ratio`` tokens of
  the window.
* CSA (``overlap=True``): projections are ``2 * head_dim`` wide. The first half of a
  token's row (``Ca``) feeds the *next* window's entry, the second half (``Cb``) its own
  window's; each entry is a softmax over ``2 * ratio`` slots. Window 0 has no previous
  window, so those slots get a gate of ``-inf`` (weight 0).
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear

from .cache import CompressorState
from .norm import InputDtypeRMSNorm
from .rope import PartialRoPE
from .stacked import StackedCompressor


class Compressor(Module):
    """One compressor; parameter names follow DeepSeek's checkpoint (wkv, wgate, ape, norm)."""

    def __init__(
        self, hidden_size: int, head_dim: int, ratio: int, overlap: bool, eps: float
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.head_dim = head_dim
        self.ratio = ratio
        self.overlap = overlap
        width = 2 * head_dim if overlap else head_dim
        self.wkv = Linear(hidden_size, width, bias=False)
        self.wgate = Linear(hidden_size, width, bias=False)
        self.ape = mx.zeros((ratio, width), dtype=mx.float32)
        self.norm = InputDtypeRMSNorm(head_dim, eps=eps)

    def make_state(self) -> CompressorState:
        return CompressorState(self.ratio, self.overlap)

    def __call__(
        self,
        x: mx.array,
        state: CompressorState,
        start: int,
        rope: PartialRoPE,
        projected: tuple[mx.array, mx.array] | None = None,
    ) -> mx.array | None:
        """Add the rows of ``x`` (positions ``start ..``); return all entries so far.
        ``projected``: ``(wkv(x), wgate(x))``, made already (a decode step makes them
        in one matmul with others: ``Attention._projections``)."""
        state.append_raw(*(projected or (self.wkv(x), self.wgate(x))))
        closed = (start + x.shape[1]) // self.ratio
        first = state.num_entries
        if closed > first:
            pooled = self._pool(state, first, closed)
            # Entry w sits at position w * ratio: rope's positions are scale * (offset + t).
            state.append_entries(rope(self.norm(pooled), offset=first, scale=self.ratio))
        return state.entries

    def step_stacked(
        self,
        x: mx.array,
        state: StackedCompressor,
        starts: list[int],
        rope: PartialRoPE,
        projected: tuple[mx.array, mx.array] | None = None,
    ) -> tuple[mx.array | None, mx.array]:
        """One token per row (``x`` [B, 1, hidden], row ``b`` at position ``starts[b]``);
        returns every row's entries [B, capacity, head_dim] and their mask [B, capacity].

        The rows that close an entry now are pooled in one batched computation, only on
        steps where some row closes one; the other steps append the raw rows alone.
        ``projected`` as in ``__call__``.
        """
        state.push(*(projected or (self.wkv(x), self.wgate(x))))
        closing = [(start + 1) % self.ratio == 0 for start in starts]
        if any(closing):
            pooled = self._pool_rows(*state.window())  # [B, 1, head_dim]
            first = mx.array(state.counts, dtype=mx.int32)
            state.write(rope(self.norm(pooled), offset=first, scale=self.ratio), closing)
        return state.entries, state.valid()

    def _pool(self, state: CompressorState, first: int, closed: int) -> mx.array:
        """Pool windows ``first .. closed - 1`` into [B, n, head_dim]."""
        ratio, dim = self.ratio, self.head_dim
        if not self.overlap:
            return self._pool_rows(*state.raw_rows(first * ratio, closed * ratio))
        # The rows of windows first-1 .. closed-1: window w reads Ca of w-1 and Cb of w.
        kv, gate = state.raw_rows(max(first - 1, 0) * ratio, closed * ratio)
        if first == 0:
            batch = kv.shape[0]
            empty = mx.zeros((batch, ratio, 2 * dim), dtype=kv.dtype)
            kv = mx.concatenate([empty, kv], axis=1)
            gate = mx.concatenate([mx.full(empty.shape, -mx.inf, dtype=gate.dtype), gate], axis=1)
        return self._pool_rows(kv, gate)

    def _pool_rows(self, kv: mx.array, gate: mx.array) -> mx.array:
        """Pool consecutive windows of raw rows [B, m * ratio, width] into [B, n, head_dim]:
        ``n = m`` without overlap, ``n = m - 1`` with (window ``w`` reads Ca of the rows
        before it and Cb of its own)."""
        ratio, dim = self.ratio, self.head_dim
        batch = kv.shape[0]
        kv = kv.reshape(batch, -1, ratio, kv.shape[-1])
        gate = gate.reshape(batch, -1, ratio, gate.shape[-1]) + self.ape
        if not self.overlap:
            return mx.sum(kv * mx.softmax(gate, axis=2, precise=True), axis=2)
        slots_kv = mx.concatenate([kv[:, :-1, :, :dim], kv[:, 1:, :, dim:]], axis=2)
        slots_gate = mx.concatenate([gate[:, :-1, :, :dim], gate[:, 1:, :, dim:]], axis=2)
        return mx.sum(slots_kv * mx.softmax(slots_gate, axis=2, precise=True), axis=2)
