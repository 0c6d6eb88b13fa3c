"""Lightning indexer of the compressed-sparse-attention (CSA) layers.

The indexer has its own overlapping compressor (at ``index_head_dim``) whose entries
are the index keys. A query scores entry ``s`` as
``sum_h w_h * relu(q_h . k_s) * index_head_dim**-0.5`` with
``w = weights_proj(x) * index_n_heads**-0.5`` and keeps the ``index_topk`` best
entries among the causally visible ones (entry ``w`` is visible to position ``t`` iff
``(w + 1) * ratio <= t + 1``).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear

from mlxserve.models.in_flight import InFlight

from .cache import CompressorState
from .compressor import Compressor
from .config import CSA, ModelArgs
from .rope import PartialRoPE
from .stacked import StackedCompressor

#: About how many bytes one query group's float32 index scores may take (3 copies).
SCORE_BYTES = 1 << 30


def visible_entries(start: int, length: int, ratio: int) -> mx.array:
    """How many entries each of the ``length`` queries from ``start`` on may see: [S, 1]."""
    return ((start + 1 + mx.arange(length)) // ratio)[:, None]


@cache
def _negated_terms(head_dim: int, heads: int) -> Any:
    """``-(relu(score) * head_dim**-0.5) * (weight * heads**-0.5)`` as one compiled
    element-wise string (shapeless: the number of entries grows)."""
    scale, weight_scale = head_dim**-0.5, heads**-0.5

    def terms(scores: mx.array, weights: mx.array) -> mx.array:
        weighted = weights.astype(mx.float32) * weight_scale
        out: mx.array = (mx.maximum(scores, 0.0) * -scale) * weighted
        return out

    return mx.compile(terms, shapeless=True)


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
        # A forward of several queries scores a group of them at a time (`_select_groups`);
        # False scores them all at once: the baseline a benchmark measures against.
        self.grouped_scores = True
        # Bytes of float32 scores one group of queries may hold at once (tests shrink it).
        self.score_bytes = SCORE_BYTES

    def __call__(
        self,
        x: mx.array,
        q_residual: mx.array,
        state: CompressorState,
        start: int,
        rope: PartialRoPE,
        projected: tuple[mx.array, mx.array, mx.array] | None = None,
    ) -> mx.array | None:
        """Update the index keys; return the top-k entry ids [B, S, k] (-1: none).

        Returns ``None`` when every visible entry is selected anyway (no more entries
        than ``index_topk``): the caller then uses the plain causal rule, which is
        exactly what the reference computes and avoids scoring. ``projected``: the
        compressor's ``wkv(x)``, ``wgate(x)`` and ``weights_proj(x)``, made already
        (a decode step's, ``Attention._projections``); a decode step then scores
        through `_decode_picks`.
        """
        keys = self.compressor(x, state, start, rope, None if projected is None else projected[:2])
        if keys is None or keys.shape[1] <= self.index_topk:
            return None
        sees_all = x.shape[1] == 1 and keys.shape[1] <= (start + 1) // self.ratio
        if projected is not None and sees_all:
            return self._decode_picks(q_residual, keys, start, rope, projected[2])
        if x.shape[1] > 1 and self.grouped_scores:
            return self._select_groups(x, q_residual, keys, start, rope)
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
        projected: tuple[mx.array, mx.array, mx.array] | None = None,
    ) -> tuple[mx.array, mx.array] | None:
        """``__call__`` for stacked rows, one token each (``offsets`` [B]: ``starts``).

        Returns the picked entry ids [B, k] and whether each is a real entry of its row
        (rows hold different numbers of entries; the padding scores ``-inf``), or
        ``None`` when the capacity is within ``index_topk``: every entry is picked.
        """
        own = None if projected is None else projected[:2]
        keys, valid = self.compressor.step_stacked(x, state, starts, rope, own)
        if keys is None or keys.shape[1] <= self.index_topk:
            return None
        if projected is not None:
            ranked = self._ranked(q_residual, keys, offsets, rope, projected[2])[:, 0]
            # Padding ranks last (+inf: -(-inf)), as in the plain scores below.
            ranked = mx.where(valid, ranked, mx.inf)
            chosen = mx.argpartition(ranked, self.index_topk - 1, axis=-1)[..., : self.index_topk]
            chosen = mx.stop_gradient(chosen)
            return chosen, mx.take_along_axis(valid, chosen, axis=-1)
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

    def _ranked(
        self,
        q_residual: mx.array,
        keys: mx.array,
        offset: int | mx.array,
        rope: PartialRoPE,
        weights: mx.array,
    ) -> mx.array:
        """`_scores` negated, [B, 1, N], for one query per row, ``weights`` its
        ``weights_proj(x)`` [B, 1, H]: the products before the sum over the heads
        are one compiled element-wise string, negated in it (each term exactly the
        negation of `_scores`' term, summed in the same order), so the sum is what
        ``argpartition`` ranks, with no negation of its own."""
        batch = q_residual.shape[0]
        q = self.wq_b(q_residual).reshape(batch, 1, self.num_heads, self.head_dim)
        q = rope(q.swapaxes(1, 2), offset=offset).astype(mx.float32)  # [B, H, 1, d]
        scores = q @ keys.astype(mx.float32)[:, None].swapaxes(-1, -2)  # [B, H, 1, N]
        terms = _negated_terms(self.head_dim, self.num_heads)
        out: mx.array = mx.sum(terms(scores, weights.swapaxes(1, 2)[..., None]), axis=1)
        return out

    def _decode_picks(
        self,
        q_residual: mx.array,
        keys: mx.array,
        offset: int,
        rope: PartialRoPE,
        weights: mx.array,
    ) -> mx.array:
        """`_top` of `_scores` for one query that sees every entry (`_ranked`). The
        ids stay uint32 (``take_along_axis`` takes them): [B, 1, k]."""
        ranked = self._ranked(q_residual, keys, offset, rope, weights)
        chosen = mx.argpartition(ranked, self.index_topk - 1, axis=-1)[..., : self.index_topk]
        return mx.stop_gradient(chosen)

    def _select_groups(
        self,
        x: mx.array,
        q_residual: mx.array,
        keys: mx.array,
        start: int,
        rope: PartialRoPE,
    ) -> mx.array:
        """The picks [B, S, k] (-1: none) of a forward of several queries, a group of
        queries at a time.

        All of a prefill chunk's scores at once are [B, H, S, N] float32, several
        copies (13 GB a copy for 2,048 queries at 100K). A group's scores cover only
        the entries its last query sees and fit ``SCORE_BYTES``, so the working set
        does not grow with the context. Each score is `_scores`' (the same ops), and
        a query that sees at most ``index_topk`` entries picks all of them without
        scoring (as the top-k of its masked scores would). Each group is queued for
        the device before the next is built, at most two at once (`InFlight`): a GPU
        otherwise holds every group the host has encoded."""
        batch, length, _ = x.shape
        k = self.index_topk
        q = self.wq_b(q_residual).reshape(batch, length, self.num_heads, self.head_dim)
        q = rope(q.swapaxes(1, 2), offset=start).astype(mx.float32)  # [B, H, S, d]
        keys_t = keys.astype(mx.float32)[:, None].swapaxes(-1, -2)  # [B, 1, d, N]
        weights = self.weights_proj(x).astype(mx.float32) * (self.num_heads**-0.5)
        weights = weights.swapaxes(1, 2)[..., None]  # [B, H, S, 1]
        group = max(1, min(length, self.score_bytes // (3 * 4 * self.num_heads * keys.shape[1])))
        picks: list[mx.array] = []
        in_flight = InFlight()
        for g0 in range(0, length, group):
            if picks:  # the previous group queued before this one is built (`InFlight`)
                in_flight.queue(picks[-1])
            g1 = min(g0 + group, length)
            visible = visible_entries(start + g0, g1 - g0, self.ratio)  # [n, 1]
            seen = min((start + g1) // self.ratio, keys.shape[1])  # the group's last query's
            if seen <= k:
                ids = mx.arange(k, dtype=mx.int32)[None]
                every = mx.where(ids < visible, ids, -1)[None]
                picks.append(mx.broadcast_to(every, (batch, g1 - g0, k)))
                continue
            scores = q[:, :, g0:g1] @ keys_t[..., :seen]  # [B, H, n, m]
            scores = mx.maximum(scores, 0.0) * (self.head_dim**-0.5)
            scores = mx.sum(scores * weights[:, :, g0:g1], axis=1)  # [B, n, m]
            scores = mx.where(mx.arange(seen)[None, :] < visible, scores, -mx.inf)
            chosen = self._top(scores)
            picks.append(mx.where(chosen < visible, chosen, -1))
        return picks[0] if len(picks) == 1 else mx.concatenate(picks, axis=1)

    def _top(self, scores: mx.array) -> mx.array:
        """The ids of the ``index_topk`` best scores on the last axis."""
        k = self.index_topk
        chosen = mx.argpartition(-scores, k - 1, axis=-1)[..., :k].astype(mx.int32)
        # A discrete selection: no gradient through it (the indexer is not trained here).
        return mx.stop_gradient(chosen)
