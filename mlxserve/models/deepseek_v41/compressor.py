"""mlx-lm's V4.1 KV compressor, telling the cache the raw rows it projects.

Why: a speculative verify may add positions that close a compressed group, and then
be partly rejected; the cache can only reopen that group if it kept the group's
projected rows (``cache.LayerCache.remember_raw``). mlx-lm's ``Compressor`` keeps
none, so this one is its ``__call__`` with that one addition; the parameters and the
maths are mlx-lm's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v41 as text

from .cache import LayerCache


class Compressor(text.Compressor):
    """``mlx_lm.models.deepseek_v41.Compressor`` that reports its raw rows."""

    def __call__(self, x: mx.array, start_pos: int, cache: Any) -> tuple[mx.array | None, int]:
        if self.ratio == 1:
            return self.kv_norm(self.kv_proj(x)), start_pos
        h = x.astype(mx.float32)
        new_kv, new_gate = self.kv_proj(h), self.gate_proj(h)
        if isinstance(cache, LayerCache):
            cache.remember_raw(new_kv, new_gate)
        pending = 0 if cache.pending_kv is None else cache.pending_kv.shape[1]
        kv = text._append(cache.pending_kv, new_kv)
        gate = text._append(cache.pending_gate, new_gate)
        full = kv.shape[1] - kv.shape[1] % self.ratio
        cache.pending_kv = kv[:, full:]
        cache.pending_gate = gate[:, full:]
        # A group takes the position of its first token (mlx-lm's convention).
        first = (start_pos - pending) // self.ratio
        if full == 0:
            return None, first
        batch, _, dim = kv.shape
        kv = kv[:, :full].reshape(batch, -1, self.ratio, dim)
        gate = gate[:, :full].reshape(batch, -1, self.ratio, dim)
        latent = mx.sum(kv * mx.softmax(gate, axis=2), axis=2)
        return self.kv_norm(latent.astype(x.dtype)), first
