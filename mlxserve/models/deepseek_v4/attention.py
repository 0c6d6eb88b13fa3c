"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries.

All three layer types share the core: a low-rank query with a per-head weightless
RMSNorm, one K=V head (``wkv`` + ``norm``), partial interleaved RoPE, learned
per-head sinks, scale ``head_dim**-0.5`` and a grouped low-rank output projection
(``wo_a`` per group, then ``wo_b``). Since K=V carries RoPE, the output gets the
inverse rotation at the query position.

* sliding: keys are the last ``sliding_window`` positions (the query included).
* HCA (ratio 128): plus every causally complete compressed entry.
* CSA (ratio 4): plus the ``index_topk`` entries the indexer picks per query.

A decoding query sees its whole window and every closed entry, or its gathered picks
(so its cost does not grow with the number of entries): one SDPA call, no mask. A
forward of several queries (a verify, a prefill chunk) gives each its own window and
entries: one SDPA call with a boolean mask, or, where the tuning's
``split_attention_queries`` says so (by default on CUDA, for a verify's 2-8 queries;
``mlxserve.kernels.attention``), one unmasked call per query over exactly the keys it
sees.

A batch of sequences comes as ``RowCaches`` (each row's own cache: the core runs row
by row, any number of tokens) or, for decode steps, as ``StackedRows`` (the rows'
state in [B, ...] tensors: the core runs once for the batch, each row masked to its
own window and entries; see ``stacked.py``).
"""

from __future__ import annotations

import logging
from functools import cache

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from mlxserve.hardware.tuning import default_tuning
from mlxserve.kernels.attention import blocked_queries, split_queries

from .cache import LayerCache, RowCaches
from .compressor import Compressor
from .config import CSA, SLIDING, ModelArgs
from .fused_linears import fused
from .indexer import Indexer, visible_entries
from .moe import quantized_experts
from .norm import InputDtypeRMSNorm
from .prefill_attention import WORKING_BYTES, groups_major, prefill_attention
from .rope import PartialRoPE
from .stacked import StackedRows


def window_mask(start: int, length: int, previous: int, window: int) -> mx.array:
    """[S, previous + S] mask of the window rows each query sees (itself included)."""
    query = start + mx.arange(length)[:, None]
    key = start - previous + mx.arange(previous + length)[None, :]
    return (key <= query) & (query - key < window)


def selection_mask(chosen: mx.array, num_entries: int) -> mx.array:
    """[B, S, N] mask with the indexer's picks (ids of -1 pick nothing)."""
    batch, length, _ = chosen.shape
    safe = mx.where(chosen >= 0, chosen, num_entries)
    mask = mx.zeros((batch, length, num_entries + 1), dtype=mx.bool_)
    mask = mx.put_along_axis(mask, safe, mx.array(True), axis=-1)
    return mask[..., :num_entries]


log = logging.getLogger(__name__)


@cache
def _group_ids(groups: int) -> mx.array:
    """[1, groups] uint32 ids of the output groups, made once (a constant)."""
    ids = mx.arange(groups, dtype=mx.uint32)[None]
    mx.eval(ids)
    return ids


def _grouped(layer: SwitchLinear | QuantizedSwitchLinear, out: mx.array) -> mx.array:
    """``layer(out, group ids)`` for [N, groups, 1, d] with the rows' ids given."""
    rows, groups = out.shape[0], out.shape[1]
    ids = mx.broadcast_to(_group_ids(groups), (rows, groups))
    if isinstance(layer, QuantizedSwitchLinear):
        return quantized_experts(layer, out, ids)
    lhs = mx.broadcast_to(_row_ids(rows, groups), ids.shape)
    weight = layer["weight"].swapaxes(-1, -2)
    grouped: mx.array = mx.gather_mm(out, weight, lhs_indices=lhs, rhs_indices=ids)
    return grouped


@cache
def grouped_agrees() -> bool:
    """Whether `_grouped` builds and equals the layer's own call here, float and
    quantised (once per process); else the layer's call is used, with a warning."""
    try:
        worst = 0.0
        layer = SwitchLinear(64, 32, 4, bias=False)
        layer.weight = mx.random.normal(layer.weight.shape, key=mx.random.key(2))
        out = mx.random.normal((3, 4, 1, 64), key=mx.random.key(3))
        for candidate in (layer, layer.to_quantized(32, 4)):
            ours = _grouped(candidate, out)
            theirs = candidate(out, mx.arange(4)[None])
            worst = max(worst, float(mx.abs(ours - theirs).max()))
    except (RuntimeError, ValueError) as exc:
        log.warning("grouped output projection failed (%s): using the layer's call", exc)
        return False
    if not worst <= 1e-5:
        log.warning("grouped output projection differs by %g: using the layer's call", worst)
        return False
    return True


@cache
def _row_ids(rows: int, groups: int) -> mx.array:
    """[rows, groups] uint32 ids of the rows of a grouped call (a constant)."""
    ids = mx.arange(rows * groups, dtype=mx.uint32).reshape(rows, groups)
    mx.eval(ids)
    return ids


def rope_offset(cache: LayerCache | RowCaches | StackedRows) -> int | mx.array:
    """Where a forward's rotations start: the cache's offset, or each row's ([B])."""
    if isinstance(cache, RowCaches | StackedRows):
        return mx.array(cache.offsets)
    return cache.offset


class Attention(Module):
    """One attention block; parameter names follow DeepSeek's checkpoint."""

    def __init__(self, args: ModelArgs, layer_type: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.layer_type = layer_type
        self.num_heads = args.num_attention_heads
        self.head_dim = args.head_dim
        self.o_groups = args.o_groups
        self.sliding_window = args.sliding_window
        self.eps = args.rms_norm_eps
        self.ratio = args.compress_ratio(layer_type)
        assert args.qk_rope_head_dim is not None and args.rope_parameters is not None

        self.wq_a = Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = InputDtypeRMSNorm(args.q_lora_rank, eps=args.rms_norm_eps)
        self.wq_b = Linear(args.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wkv = Linear(args.hidden_size, self.head_dim, bias=False)
        self.norm = InputDtypeRMSNorm(self.head_dim, eps=args.rms_norm_eps)
        # wo_a is block diagonal, one [o_lora_rank, heads * head_dim / groups] per group;
        # SwitchLinear keeps it quantisable and shardable along the group axis.
        self.wo_a = SwitchLinear(
            self.num_heads * self.head_dim // self.o_groups,
            args.o_lora_rank,
            self.o_groups,
            bias=False,
        )
        self.wo_b = Linear(self.o_groups * args.o_lora_rank, args.hidden_size, bias=False)
        self.attn_sink = mx.zeros((self.num_heads,), dtype=mx.float32)
        self._group_ids = mx.arange(self.o_groups)[None]
        # Set by ``shard``: this rank holds some output groups, so sum ``wo_b``'s partials.
        self.sharding_group: mx.distributed.Group | None = None
        # The tuning's knob (``Model.tune``): a forward of a few queries split per query.
        self.split_attention_queries = default_tuning().split_attention_queries
        # The tuning's knob (``Model.tune``): forwards of at most this many rows call a
        # quantised ``wo_a`` with constant row ids (no ``arange`` per call).
        self.fused_max_rows = default_tuning().compiled_decode_max_rows
        # A prefill chunk attends by blocks (``prefill_attention``); False gives it the
        # one masked call of a verify forward: the baseline a benchmark measures against.
        self.blocked_prefill = True
        # Bytes a blocked prefill's group of queries may hold at once (tests shrink it).
        self.prefill_working_bytes = WORKING_BYTES

        rope_key = "main" if layer_type == SLIDING else "compress"
        self.rope = PartialRoPE(
            args.rope_parameters[rope_key], args.qk_rope_head_dim, args.max_position_embeddings
        )
        if layer_type != SLIDING:
            self.compressor = Compressor(
                args.hidden_size,
                self.head_dim,
                self.ratio,
                overlap=layer_type == CSA,
                eps=args.rms_norm_eps,
            )
        if layer_type == CSA:
            self.indexer = Indexer(args)

    def make_cache(self, max_rollback: int = 0) -> LayerCache:
        states = {}
        if self.layer_type != SLIDING:
            states["compressor"] = self.compressor.make_state()
        if self.layer_type == CSA:
            states["indexer"] = self.indexer.compressor.make_state()
        return LayerCache(self.sliding_window, states, max_rollback=max_rollback)

    def __call__(self, x: mx.array, cache: LayerCache | RowCaches | StackedRows) -> mx.array:
        batch, length, _ = x.shape
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).reshape(batch, length, self.num_heads, self.head_dim)
        q = mx.fast.rms_norm(q, None, self.eps).swapaxes(1, 2)  # [B, H, S, D]
        kv = self.norm(self.wkv(x))  # [B, S, D]
        if isinstance(cache, StackedRows) and (length != 1 or len(cache) != batch):
            raise ValueError(
                f"stacked rows take one token for each of their {len(cache)} rows; "
                f"got {batch} rows of {length}"
            )
        offset = rope_offset(cache)
        q = self.rope(q, offset=offset)
        kv = self.rope(kv, offset=offset)
        if isinstance(cache, StackedRows):
            # One token per row: the whole batch's core at once (see ``stacked.py``).
            assert isinstance(offset, mx.array)
            attended = self._attend_stacked(x, q_residual, q, kv, cache, offset)
        elif isinstance(cache, RowCaches):
            # Each row at its own position: the cache-dependent core row by row; the
            # projections and rotations (at per-row offsets) once for the whole batch.
            assert len(cache.rows) == batch
            attended = mx.concatenate(
                [
                    self._attend(
                        x[i : i + 1], q_residual[i : i + 1], q[i : i + 1], kv[i : i + 1], row
                    )
                    for i, row in enumerate(cache.rows)
                ]
            )
        else:
            attended = self._attend(x, q_residual, q, kv, cache)
        out = self.rope(attended, offset=offset, inverse=True).swapaxes(1, 2)
        out = out.reshape(batch * length, self.o_groups, 1, -1)
        out = self._output_groups(out)
        out = self.wo_b(out.reshape(batch, length, -1))
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out

    def _output_groups(self, out: mx.array) -> mx.array:
        """``wo_a`` of each output group: [N, groups, 1, d] -> [N, groups, 1, rank]."""
        rows = out.shape[0]
        layer = self.wo_a
        if (
            type(layer) in (QuantizedSwitchLinear, SwitchLinear)
            and "bias" not in layer
            and rows <= self.fused_max_rows
            and int(self._group_ids.size) == out.shape[1]
            and grouped_agrees()
        ):
            return _grouped(layer, out)
        if (
            self.blocked_prefill
            and blocked_queries(rows)
            and isinstance(layer, QuantizedSwitchLinear | SwitchLinear)
        ):
            return groups_major(layer, out)  # a prefill chunk: one matmul per group
        grouped: mx.array = layer(out, self._group_ids)
        return grouped

    def fill_window(self, x: mx.array, cache: LayerCache | RowCaches) -> None:
        """Leave in a sliding layer's cache what ``__call__`` on ``x`` would, without
        attending: the rotated K=V rows of ``x`` [B, S, D] join each row's window.

        A position's K=V row depends on that position's input alone, so a caller that
        only needs the cache (the MTP entries of positions already decoded) skips the
        queries, the attention core, which ``RowCaches`` builds row by row, and the
        output projections. The same ops in the same order as ``__call__``, so the
        window is the one the full forward leaves."""
        if self.layer_type != SLIDING:
            raise ValueError(f"only a sliding layer's cache fills alone, not {self.layer_type}'s")
        length = x.shape[1]
        rows = cache.rows if isinstance(cache, RowCaches) else [cache]
        if len(rows) != x.shape[0]:
            raise ValueError(f"{len(rows)} caches for {x.shape[0]} rows")
        kv = self.rope(self.norm(self.wkv(x)), offset=rope_offset(cache))
        for i, row in enumerate(rows):
            row.update_window(kv[i : i + 1])
            row.advance(length)

    def _attend(
        self, x: mx.array, q_residual: mx.array, q: mx.array, kv: mx.array, cache: LayerCache
    ) -> mx.array:
        """Attend (rotated ``q``, ``kv``) over the window and the compressed entries;
        returns [B, H, S, D], still rotated."""
        length = x.shape[1]
        if length == 1 and x.shape[0] <= self.fused_max_rows:
            return self._attend_one(x, q_residual, q, kv, cache)
        start = cache.offset
        previous = 0 if cache.window is None else int(cache.window.shape[1])
        previous = min(previous, self.sliding_window - 1)
        keys = cache.update_window(kv)
        keys = keys[:, keys.shape[1] - previous - length :]
        entries, chosen = None, None
        if self.layer_type != SLIDING:
            entries, chosen = self._compressed(x, q_residual, cache)
        cache.advance(length)
        if length == 1:
            # One query sees its whole window and every closed entry, or all its picks
            # (it sees every entry, and there are more than index_topk): no mask.
            if entries is not None:
                if chosen is not None:  # cast after the pick: k entries, not all of them
                    entries = mx.take_along_axis(entries, chosen[:, 0, :, None], axis=1)
                keys = mx.concatenate([keys, entries.astype(keys.dtype)], axis=1)
            return self._sdpa(q, keys, None)
        if self.blocked_prefill and blocked_queries(length):
            # A prefill chunk: each query over only the keys it sees (prefill_attention).
            return prefill_attention(
                q,
                keys,
                previous,
                self.sliding_window,
                self.attn_sink,
                self.head_dim**-0.5,
                entries,
                chosen,
                start,
                self.ratio,
                budget=self.prefill_working_bytes,
            )
        if split_queries(length, self.split_attention_queries) and (
            chosen is None or (start + 1) // self.ratio >= self.indexer.index_topk
        ):
            # (With picks, the first query already sees index_topk entries, so every
            # pick of every query is a real one.) Each query gets the unmasked call a
            # decode step at its position makes (`mlxserve.kernels.attention`).
            return mx.concatenate(
                [
                    self._sdpa(
                        q[:, :, i : i + 1],
                        self._query_keys(i, start, previous, keys, entries, chosen),
                        None,
                    )
                    for i in range(length)
                ],
                axis=2,
            )
        mask = window_mask(start, length, previous, self.sliding_window)
        mask = mx.broadcast_to(mask, (x.shape[0], length, previous + length))
        if entries is not None:
            keys, mask = self._add_entries(start, length, keys, mask, entries, chosen)
        return self._sdpa(q, keys, mask)

    def _attend_one(
        self, x: mx.array, q_residual: mx.array, q: mx.array, kv: mx.array, cache: LayerCache
    ) -> mx.array:
        """`_attend` of one query (a decode step), its small ops fused: the compressors'
        and the indexer's projections of ``x`` as one matmul (`_projections`), and the
        window, the new row and the entries it sees as one concatenation (its keys)."""
        previous = 0 if cache.window is None else int(cache.window.shape[1])
        previous = min(previous, self.sliding_window - 1)
        seen = None
        if self.layer_type != SLIDING:
            entries, chosen = self._compressed(x, q_residual, cache, self._projections(x))
            if entries is not None:
                if chosen is not None:  # cast after the pick: k entries, not all of them
                    entries = mx.take_along_axis(entries, chosen[:, 0, :, None], axis=1)
                seen = entries.astype(kv.dtype)
        keys = cache.update_window(kv, seen)
        cache.advance(1)
        # One query sees its whole window and every closed entry, or all its picks (it
        # sees every entry, and there are more than index_topk): no mask.
        first = keys.shape[1] - (0 if seen is None else seen.shape[1]) - previous - 1
        return self._sdpa(q, keys[:, first:], None)

    def _projections(self, x: mx.array) -> dict[str, mx.array]:
        """The compressors' (and the indexer's weights') projections of ``x``, by name,
        those of one kind as one matmul (``fused_linears.py``)."""
        layers = {"kv": self.compressor.wkv, "gate": self.compressor.wgate}
        if self.layer_type == CSA:
            index = self.indexer
            layers["index_kv"] = index.compressor.wkv
            layers["index_gate"] = index.compressor.wgate
            layers["index_weights"] = index.weights_proj
        outputs = fused(self, "_decode_inputs", list(layers.values()))(x)
        return dict(zip(layers, outputs, strict=True))

    def _sdpa(self, q: mx.array, keys: mx.array, mask: mx.array | None) -> mx.array:
        """One attention call; K = V, ``mask`` [B, S, keys] or None."""
        out: mx.array = mx.fast.scaled_dot_product_attention(
            q,
            keys[:, None],
            keys[:, None],
            scale=self.head_dim**-0.5,
            mask=None if mask is None else mask[:, None],
            sinks=self.attn_sink.astype(q.dtype),
        )
        return out

    def _query_keys(
        self,
        i: int,
        start: int,
        previous: int,
        window: mx.array,
        entries: mx.array | None,
        chosen: mx.array | None,
    ) -> mx.array:
        """The keys query ``i`` of a forward sees: its window rows, then its entries."""
        last = previous + i
        keys = window[:, max(0, last - self.sliding_window + 1) : last + 1]
        if entries is None:
            return keys
        if chosen is not None:
            seen = mx.take_along_axis(entries, chosen[:, i, :, None], axis=1)
        else:
            seen = entries[:, : (start + 1 + i) // self.ratio]
        return mx.concatenate([keys, seen.astype(keys.dtype)], axis=1) if seen.shape[1] else keys

    def join_entries(
        self,
        keys: mx.array,
        mask: mx.array | None,
        entries: mx.array,
        valid: mx.array,
        picked: tuple[mx.array, mx.array] | None,
    ) -> tuple[mx.array, mx.array]:
        """Stacked rows' window keys [B, W, D] and mask (None: all valid) joined with
        the compressed entries each row sees: all of them (``valid`` masks what a row
        has not reached), or the indexer's ``picked`` (chosen ids, their validity)."""
        if picked is not None:
            chosen, valid = picked
            entries = mx.take_along_axis(entries, chosen[..., None], axis=1)
        keys = mx.concatenate([keys, entries.astype(keys.dtype)], axis=1)
        if mask is None:
            mask = mx.ones((keys.shape[0], self.sliding_window), dtype=mx.bool_)
        return keys, mx.concatenate([mask, valid], axis=-1)

    def _attend_stacked(
        self,
        x: mx.array,
        q_residual: mx.array,
        q: mx.array,
        kv: mx.array,
        cache: StackedRows,
        offsets: mx.array,
    ) -> mx.array:
        """``_attend`` for stacked rows, one query each: one SDPA for the batch, each row
        masked to its own window and entries."""
        keys, mask = cache.update_window(kv)
        if self.layer_type != SLIDING:
            starts = cache.offsets
            projected = self._projections(x) if x.shape[0] <= self.fused_max_rows else None
            own = None if projected is None else (projected["kv"], projected["gate"])
            entries, valid = self.compressor.step_stacked(
                x, cache.compressors["compressor"], starts, self.rope, own
            )
            picked = None
            if self.layer_type == CSA:
                index = None
                if projected is not None:
                    index = (
                        projected["index_kv"],
                        projected["index_gate"],
                        projected["index_weights"],
                    )
                state = cache.compressors["indexer"]
                picked = self.indexer.select_stacked(
                    x, q_residual, state, starts, offsets, self.rope, index
                )
            if entries is not None:
                keys, mask = self.join_entries(keys, mask, entries, valid, picked)
        cache.advance()
        out: mx.array = mx.fast.scaled_dot_product_attention(
            q,
            keys[:, None],
            keys[:, None],
            scale=self.head_dim**-0.5,
            mask=None if mask is None else mask[:, None, None],
            sinks=self.attn_sink.astype(q.dtype),
        )
        return out

    def _compressed(
        self,
        x: mx.array,
        q_residual: mx.array,
        cache: LayerCache,
        projected: dict[str, mx.array] | None = None,
    ) -> tuple[mx.array | None, mx.array | None]:
        """This layer's compressed entries [B, N, D] (None before the first closes) and,
        in CSA layers past ``index_topk`` entries, the indexer's picks [B, S, k].
        ``projected``: `_projections` of ``x``, made already."""
        start = cache.offset
        state = cache.compressors["compressor"]
        own = None if projected is None else (projected["kv"], projected["gate"])
        entries = self.compressor(x, state, start, self.rope, own)
        chosen = None
        if self.layer_type == CSA:
            index = None
            if projected is not None:
                index = (projected["index_kv"], projected["index_gate"], projected["index_weights"])
            state = cache.compressors["indexer"]
            chosen = self.indexer(x, q_residual, state, start, self.rope, index)
        return entries, chosen

    def _add_entries(
        self,
        start: int,
        length: int,
        keys: mx.array,
        mask: mx.array,
        entries: mx.array,
        chosen: mx.array | None,
    ) -> tuple[mx.array, mx.array]:
        """Append the entries to the keys and extend the window mask with what each
        query sees of them: the causally closed ones, or its picks."""
        if chosen is None:
            visible = mx.arange(entries.shape[1])[None, :] < visible_entries(
                start, length, self.ratio
            )
            extra = mx.broadcast_to(visible, (keys.shape[0], length, entries.shape[1]))
        else:
            extra = selection_mask(chosen, entries.shape[1])
        keys = mx.concatenate([keys, entries.astype(keys.dtype)], axis=1)
        return keys, mx.concatenate([mask, extra], axis=-1)
