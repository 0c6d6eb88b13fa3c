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
from mlx.nn.layers.normalization import RMSNorm

from .cache import CompressorState
from .rope import PartialRoPE


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
        self.norm = RMSNorm(head_dim, eps=eps)

    def make_state(self) -> CompressorState:
        return CompressorState(self.ratio, self.overlap)

    def __call__(
        self, x: mx.array, state: CompressorState, start: int, rope: PartialRoPE
    ) -> mx.array | None:
        """Add the rows of ``x`` (positions ``start ..``); return all entries so far."""
        state.append_raw(self.wkv(x), self.wgate(x))
        closed = (start + x.shape[1]) // self.ratio
        first = state.num_entries
        if closed > first:
            pooled = self._pool(state, first, closed)
            # Entry w sits at position w * ratio: rope's positions are scale * (offset + t).
            state.append_entries(rope(self.norm(pooled), offset=first, scale=self.ratio))
        return state.entries

    def _pool(self, state: CompressorState, first: int, closed: int) -> mx.array:
        """Pool windows ``first .. closed - 1`` into [B, n, head_dim]."""
        ratio, dim = self.ratio, self.head_dim
        n = closed - first
        if not self.overlap:
            kv, gate = state.raw_rows(first * ratio, closed * ratio)
            kv = kv.reshape(kv.shape[0], n, ratio, -1)
            gate = gate.reshape(gate.shape[0], n, ratio, -1) + self.ape
            return mx.sum(kv * mx.softmax(gate, axis=2, precise=True), axis=2)

        # The rows of windows first-1 .. closed-1: window w reads Ca of w-1 and Cb of w.
        kv, gate = state.raw_rows(max(first - 1, 0) * ratio, closed * ratio)
        batch = kv.shape[0]
        kv = kv.reshape(batch, -1, ratio, 2 * dim)
        gate = gate.reshape(batch, -1, ratio, 2 * dim) + self.ape
        if first == 0:
            empty = mx.zeros((batch, 1, ratio, 2 * dim), dtype=kv.dtype)
            kv = mx.concatenate([empty, kv], axis=1)
            gate = mx.concatenate([mx.full(empty.shape, -mx.inf, dtype=gate.dtype), gate], axis=1)
        slots_kv = mx.concatenate([kv[:, :-1, :, :dim], kv[:, 1:, :, dim:]], axis=2)
        slots_gate = mx.concatenate([gate[:, :-1, :, :dim], gate[:, 1:, :, dim:]], axis=2)
        return mx.sum(slots_kv * mx.softmax(slots_gate, axis=2, precise=True), axis=2)
