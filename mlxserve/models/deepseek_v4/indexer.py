"""Lightning indexer of the compressed-sparse-attention (CSA) layers.

The indexer has its own overlapping compressor (at ``index_head_dim``) whose entries
are the index keys. A query scores entry ``s`` as
``sum_h w_h * relu(q_h . k_s) * index_head_dim**-0.5`` with
``w = weights_proj(x) * index_n_heads**-0.5`` and keeps the ``index_topk`` best
entries among the causally visible ones (entry ``w`` is visible to position ``t`` iff
``(w + 1) * ratio <= t + 1``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear

from .cache import CompressorState
from .compressor import Compressor
from .config import CSA, ModelArgs
from .rope import PartialRoPE
from .stacked import StackedCompressor


def visible_entries(start: int, length: int, ratio: int) -> mx.array:
    """How many entries each of the ``length`` queries from ``start`` on may see: [S, 1]."""
    return ((start + 1 + mx.arange(length)) // ratio)[:, None]


class Indexer(Module):
    """Scores compressed entries per query and picks the top ``index_topk``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ratio = args.compress_ratio(CSA)
        self.num_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.index_topk = args.index_topk
        self.compressor = Compressor(
            args.hidden_size, self.head_dim, self.ratio, overlap=True, eps=args.rms_norm_eps
        )
        self.wq_b = Linear(args.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = Linear(args.hidden_size, self.num_heads, bias=False)

    def __call__(
        self,
        x: mx.array,
        q_residual: mx.array,
        state: CompressorState,
        start: int,
        rope: PartialRoPE,
    ) -> mx.array | None:
        """Update the index keys; return the top-k entry ids [B, S, k] (-1: none).

        Returns ``None`` when every visible entry is selected anyway (no more entries
        than ``index_topk``): the caller then uses the plain causal rule, which is
        exactly what the reference computes and avoids scoring.
        """
        keys = self.compressor(x, state, start, rope)
        if keys is None or keys.shape[1] <= self.index_topk:
            return None
        scores = self._scores(x, q_residual, keys, start, rope)  # [B, S, N]
        if x.shape[1] == 1 and keys.shape[1] <= (start + 1) // self.ratio:
            # One query that sees every entry (a decode step): nothing to mask.
            return self._top(scores)
        visible = visible_entries(start, x.shape[1], self.ratio)
        scores = mx.where(mx.arange(keys.shape[1])[None, :] < visible, scores, -mx.inf)
        chosen = self._top(scores)
        return mx.where(chosen < visible, chosen, -1)

    def select_stacked(
        self,
        x: mx.array,
        q_residual: mx.array,
        state: StackedCompressor,
        starts: list[int],
        offsets: mx.array,
        rope: PartialRoPE,
    ) -> tuple[mx.array, mx.array] | None:
        """``__call__`` for stacked rows, one token each (``offsets`` [B]: ``starts``).

        Returns the picked entry ids [B, k] and whether each is a real entry of its row
        (rows hold different numbers of entries; the padding scores ``-inf``), or
        ``None`` when the capacity is within ``index_topk``: every entry is picked.
        """
        keys, valid = self.compressor.step_stacked(x, state, starts, rope)
        if keys is None or keys.shape[1] <= self.index_topk:
            return None
        scores = self._scores(x, q_residual, keys, offsets, rope)[:, 0]  # [B, N]
        chosen = self._top(mx.where(valid, scores, -mx.inf))
        return chosen, mx.take_along_axis(valid, chosen, axis=-1)

    def _scores(
        self,
        x: mx.array,
        q_residual: mx.array,
        keys: mx.array,
        offset: int | mx.array,
        rope: PartialRoPE,
    ) -> mx.array:
        """Every query's score of every entry: [B, S, N]."""
        batch, length, _ = x.shape
        q = self.wq_b(q_residual).reshape(batch, length, self.num_heads, self.head_dim)
        q = rope(q.swapaxes(1, 2), offset=offset).astype(mx.float32)  # [B, H, S, d]
        scores = q @ keys.astype(mx.float32)[:, None].swapaxes(-1, -2)  # [B, H, S, N]
        scores = mx.maximum(scores, 0.0) * (self.head_dim**-0.5)
        weights = self.weights_proj(x).astype(mx.float32) * (self.num_heads**-0.5)  # [B, S, H]
        return mx.sum(scores * weights.swapaxes(1, 2)[..., None], axis=1)

    def _top(self, scores: mx.array) -> mx.array:
        """The ids of the ``index_topk`` best scores on the last axis."""
        k = self.index_topk
        chosen = mx.argpartition(-scores, k - 1, axis=-1)[..., :k].astype(mx.int32)
        # A discrete selection: no gradient through it (the indexer is not trained here).
        return mx.stop_gradient(chosen)
