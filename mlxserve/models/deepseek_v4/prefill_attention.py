"""Attention of a long forward (a prefill chunk): each query over its own window and
its own entries, with work and memory that do not grow with the whole context.

One masked ``scaled_dot_product_attention`` over ``[window rows + every entry]`` (what
``Attention._attend`` does for a few queries) scores every query against every key of
the chunk: 2,048 queries against a 2,175-row window where each sees 128, and, in a
CSA layer, against all ``context / 4`` entries where each sees its 512 picks (16x
the work at 32K, 50x at 100K, and a [64, 2048, 27,775] score tensor at 100K). With a
512-wide head neither MLX's CUDA kernels nor its CPU have a fused attention, so the
call is that dense matmul, a select and a softmax, all of it materialised.

Here the same softmax is computed over only the keys each query sees:

* the window, in blocks of ``window`` queries: a block's queries see its own rows
  and the ``window - 1`` rows before it, so the block's keys are two blocks of rows
  (one matmul of ``window x heads`` query rows against ``2 x window`` keys, twice the
  keys a query sees, not the whole chunk);
* the entries: a query's ``index_topk`` picks gathered (one small matmul per query,
  all 64 heads at once against its own k entries), or, without picks (HCA layers,
  CSA layers before ``index_topk`` entries), the causally closed entries of the
  query group, masked per query;
* one softmax over [sink, window scores, entry scores] per query and head, then the
  two weighted sums added.

The ops and dtypes are the fallback's (queries scaled in their dtype, scores in it,
masked to its lowest finite value, a precise softmax with the sink in front), so only
the order of a few sums differs. The queries run in groups whose scores and gathered
entries fit ``WORKING_BYTES``: the working set is bounded whatever the context. Each
group is queued for the device before the next is built, at most two at once
(`mlxserve.models.in_flight`): MLX does not schedule several groups' gathers ahead of
their products (as it did the slices of the vocabulary head, ``head.py``), and a GPU
does not hold every group the host has encoded.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
from mlx_lm.models.switch_layers import SwitchLinear

from mlxserve.models.in_flight import InFlight

#: About how many bytes one query group's scores and gathered entries may take.
WORKING_BYTES = 1 << 30


@cache
def _block_mask(block: int, window: int) -> mx.array:
    """[block, 2 * block]: query q of a block sees the block-pair keys q .. q + window - 1
    (the window rows up to its own, its own last)."""
    query = mx.arange(block)[:, None]
    key = mx.arange(2 * block)[None, :]
    mask = (key >= query) & (key <= query + window - 1)
    mx.eval(mask)
    return mask


def group_size(queries: int, block: int, per_query_bytes: int, budget: int) -> int:
    """Queries per group: a multiple of ``block`` whose ``per_query_bytes`` fit
    ``budget`` (at least one block, at most every query)."""
    blocks = max(budget // max(per_query_bytes * block, 1), 1)
    return min(blocks * block, -(-queries // block) * block)


def prefill_attention(
    q: mx.array,
    keys: mx.array,
    previous: int,
    window: int,
    sinks: mx.array,
    scale: float,
    entries: mx.array | None = None,
    chosen: mx.array | None = None,
    start: int = 0,
    ratio: int = 0,
    budget: int = WORKING_BYTES,
) -> mx.array:
    """Attention of ``q`` [B, H, S, D] (positions ``start ..``, rotated) over K = V.

    ``keys`` [B, previous + S, D]: the ``previous`` (< ``window``) kept window rows,
    then the forward's own. ``entries`` [B, N, D] (``keys``' dtype): the compressed
    entries; each query sees its ``chosen`` [B, S, k] picks (-1: none), or without
    picks every entry closed at its position (entry ``w`` for position ``t`` iff
    ``(w + 1) * ratio <= t + 1``). ``sinks`` [H]. Returns [B, H, S, D].
    """
    batch, heads, length, dim = q.shape
    block = window
    blocks = -(-length // block)
    padded = blocks * block
    # Window rows padded so query i's own row sits at i + window - 1 and every block
    # b has the rows b * block .. (b + 2) * block - 1.
    left = window - 1 - previous
    right = (blocks + 1) * block - (left + keys.shape[1])
    rows = mx.pad(keys, [(0, 0), (left, right), (0, 0)])
    pairs = mx.concatenate(
        [
            rows[:, :padded].reshape(batch, blocks, block, dim),
            rows[:, block:].reshape(batch, blocks, block, dim),
        ],
        axis=2,
    )  # [B, blocks, 2 * block, D]
    # Which block-pair keys each block's queries see: the relative window, minus the
    # left padding (only in block 0).
    position = mx.arange(blocks)[:, None] * block + mx.arange(2 * block)[None, :]
    real = (position >= left)[:, None, :]  # [blocks, 1, 2 * block]
    window_mask = (_block_mask(block, window)[None] & real)[:, :, None, :]

    entry_dtype = keys.dtype
    if entries is not None:
        entries = entries.astype(entry_dtype)
    k = 0 if chosen is None else chosen.shape[-1]
    if chosen is not None and padded > length:
        chosen = mx.pad(chosen, [(0, 0), (0, padded - length), (0, 0)], constant_values=-1)
    itemsize = q.dtype.size
    entry_columns = k if chosen is not None else (0 if entries is None else entries.shape[1])
    per_query = 4 * itemsize * heads * (1 + 2 * block + entry_columns) + 2 * k * dim * itemsize
    group = group_size(length, block, per_query, budget)
    lowest = mx.array(mx.finfo(q.dtype).min, q.dtype)
    sink_column = sinks.astype(q.dtype)[None, None, :, None]
    factor = mx.array(scale, q.dtype)

    outs: list[mx.array] = []
    in_flight = InFlight()
    for g0 in range(0, padded, group):
        if outs:  # the previous group queued before this one is built (module docstring)
            in_flight.queue(outs[-1])
        g1 = min(g0 + group, padded)
        n, b0, b1 = g1 - g0, g0 // block, g1 // block
        # The group's queries [B, n, H, D], scaled in their dtype as the SDPA fallback
        # does, the last group padded to whole blocks.
        qg = (q[:, :, g0 : min(g1, length)] * factor).swapaxes(1, 2)
        if g1 > length:
            qg = mx.pad(qg, [(0, 0), (0, g1 - length), (0, 0), (0, 0)])
        keys_g = pairs[:, b0:b1]  # [B, nb, 2 * block, D]
        q_blocks = qg.reshape(batch, b1 - b0, block * heads, dim)
        scores = (q_blocks @ keys_g.swapaxes(-1, -2)).reshape(batch, n, heads, 2 * block)
        mask = window_mask[b0:b1].reshape(1, n, 1, 2 * block)
        parts = [mx.broadcast_to(sink_column, (batch, n, heads, 1))]
        parts.append(mx.where(mask, scores, lowest))
        seen = None
        if entries is not None and chosen is not None:
            picks = chosen[:, g0:g1]  # [B, n, k]
            safe = mx.where(picks >= 0, picks, 0)
            seen = mx.take_along_axis(entries, safe.reshape(batch, n * k, 1), axis=1)
            seen = seen.reshape(batch, n, k, dim)
            picked = qg @ seen.swapaxes(-1, -2)  # [B, n, H, k]
            parts.append(mx.where((picks >= 0)[:, :, None, :], picked, lowest))
        elif entries is not None:
            # The entries closed at the group's last query (later ones no query sees).
            last = start + min(g1, length)
            seen = entries[:, : min(last // ratio, entries.shape[1])]
            if seen.shape[1]:
                closed = (start + 1 + g0 + mx.arange(n)) // ratio  # [n]
                visible = mx.arange(seen.shape[1])[None, :] < closed[:, None]  # [n, m]
                flat = (qg.reshape(batch, n * heads, dim) @ seen.swapaxes(-1, -2)).reshape(
                    batch, n, heads, -1
                )
                parts.append(mx.where(visible[None, :, None, :], flat, lowest))
            else:
                seen = None
        probs = mx.softmax(mx.concatenate(parts, axis=-1), axis=-1, precise=True)
        p_window = probs[..., 1 : 1 + 2 * block].reshape(batch, b1 - b0, block * heads, -1)
        out = (p_window @ keys_g).reshape(batch, n, heads, dim)
        if seen is not None:
            p_entries = probs[..., 1 + 2 * block :]
            if chosen is not None:
                out = out + p_entries @ seen  # [B, n, H, k] @ [B, n, k, D]
            else:
                flat = p_entries.reshape(batch, n * heads, -1) @ seen
                out = out + flat.reshape(batch, n, heads, dim)
        outs.append(out)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return out[:, :length].swapaxes(1, 2)


def groups_major(layer: Any, out: mx.array) -> mx.array:
    """``wo_a`` of many rows ([N, groups, 1, d] -> [N, groups, 1, rank]) as one matmul
    per output group over all N rows.

    The layer's own call with the group ids is a gathered matmul of N x groups
    single rows (M = 1 each): each row reads its group's weight again, and a GPU's
    tiled kernel pads every row to a tile. With the rows grouped first ([groups, N,
    d], the group's id per batch) each group is one N-row matmul; every output is the
    same dot product."""
    rows, groups = out.shape[0], out.shape[1]
    major = out.reshape(rows, groups, -1).swapaxes(0, 1)  # [groups, N, d]
    if isinstance(layer, SwitchLinear):
        # Float weights: a batched matmul, no gather (MLX's CPU gathers float32 only).
        grouped = major @ layer["weight"].swapaxes(-1, -2)  # [groups, N, rank]
        if "bias" in layer:
            grouped = grouped + layer["bias"][:, None, :]
    else:
        grouped = layer(major, mx.arange(groups, dtype=mx.uint32))
    result: mx.array = grouped.swapaxes(0, 1)[:, :, None, :]
    return result
