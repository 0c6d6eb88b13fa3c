"""A prefill chunk's attention by blocks (``prefill_attention``), its index scores by
query groups (``Indexer._select_groups``) and ``wo_a`` one group at a time
(``groups_major``) give what the masked call, all scores at once and the per-row
call give: for the core alone at every alignment of window, chunk, blocks and
groups, and for a whole model prefilled in uneven chunks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchLinear

from mlxserve.models.deepseek_v4 import prefill_attention
from mlxserve.models.deepseek_v4.attention import Attention
from mlxserve.models.deepseek_v4.indexer import Indexer
from mlxserve.models.deepseek_v4.prefill_attention import group_size, groups_major
from tests.engine.v4_models import tiny_v4

HEADS, DIM, WINDOW = 3, 8, 6


def _masked(
    q: mx.array,
    keys: mx.array,
    previous: int,
    sinks: mx.array,
    entries: mx.array | None,
    chosen: mx.array | None,
    start: int,
    ratio: int,
) -> mx.array:
    """The one masked call over every window row and entry (the reference)."""
    length = q.shape[2]
    query = start + mx.arange(length)[:, None]
    key = start - previous + mx.arange(previous + length)[None, :]
    mask = (key <= query) & (query - key < WINDOW)
    if entries is not None:
        ids = mx.arange(entries.shape[1])[None, :]
        if chosen is None:
            seen = ids < ((query + 1) // ratio)
        else:
            seen = (ids[..., None] == chosen[0][:, None, :]).any(axis=-1)
        mask = mx.concatenate([mask, seen], axis=-1)
        keys = mx.concatenate([keys, entries], axis=1)
    out: mx.array = mx.fast.scaled_dot_product_attention(
        q, keys[:, None], keys[:, None], scale=DIM**-0.5, mask=mask[None, None], sinks=sinks
    )
    return out


@pytest.mark.parametrize(
    ("previous", "length", "start", "kind", "budget"),
    [
        (0, 20, 0, "sliding", 1 << 30),
        (5, 13, 40, "sliding", 1),
        (3, 9, 3, "causal", 1 << 30),
        (5, 31, 57, "causal", 1),
        (5, 25, 80, "picks", 1 << 30),
        (2, 17, 61, "picks", 1),
    ],
)
def test_blocks_give_the_masked_call(
    previous: int, length: int, start: int, kind: str, budget: int
) -> None:
    keys_iter = iter(mx.random.split(mx.random.key(previous * 100 + length), 6))
    q = mx.random.normal((1, HEADS, length, DIM), key=next(keys_iter))
    keys = mx.random.normal((1, previous + length, DIM), key=next(keys_iter))
    sinks = mx.random.normal((HEADS,), key=next(keys_iter))
    entries = chosen = None
    ratio = 4
    if kind != "sliding":
        count = (start + length) // ratio
        entries = mx.random.normal((1, count, DIM), key=next(keys_iter))
    if kind == "picks":
        # 5 picks per query among its closed entries, some of them none (-1).
        scores = mx.random.uniform(shape=(1, length, entries.shape[1]), key=next(keys_iter))
        closed = (start + 1 + mx.arange(length))[:, None] // ratio
        scores = mx.where(mx.arange(entries.shape[1])[None, :] < closed, scores, -1.0)
        chosen = mx.argpartition(-scores, 4, axis=-1)[..., :5].astype(mx.int32)
        picked = mx.take_along_axis(scores, chosen, axis=-1)
        chosen = mx.where((picked >= 0) & (mx.arange(5) < 4), chosen, -1)
    ours = prefill_attention.prefill_attention(
        q, keys, previous, WINDOW, sinks, DIM**-0.5, entries, chosen, start, ratio, budget
    )
    theirs = _masked(q, keys, previous, sinks, entries, chosen, start, ratio)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5, rtol=1e-5)


def test_groups_hold_whole_blocks_within_the_budget() -> None:
    assert group_size(2048, 128, 1, 1 << 30) == 2048  # everything fits: one group
    assert group_size(2048, 128, 1 << 20, 512 << 20) == 512
    assert group_size(2048, 128, 1 << 30, 1) == 128  # never less than one block
    assert group_size(100, 128, 1, 1 << 30) == 128  # the padded chunk


def test_groups_major_is_the_per_row_call() -> None:
    layer = SwitchLinear(32, 16, 4, bias=False)
    layer.weight = mx.random.normal(layer.weight.shape, key=mx.random.key(1))
    out = mx.random.normal((37, 4, 1, 32), key=mx.random.key(2))
    for candidate in (layer, layer.to_quantized(32, 4)):
        theirs = candidate(out, mx.arange(4)[None])
        np.testing.assert_allclose(
            np.asarray(groups_major(candidate, out)), np.asarray(theirs), atol=1e-5, rtol=1e-5
        )


TOKENS = [(7 * i + 3) % 61 for i in range(160)]


def _logits(model: object, chunks: list[int], blocked: bool, small: bool) -> np.ndarray:
    for part in model.modules():  # type: ignore[attr-defined]
        if isinstance(part, Attention):
            part.blocked_prefill = blocked
            if small:  # a group per block
                part.prefill_working_bytes = 1
        elif isinstance(part, Indexer):
            part.grouped_scores = blocked
            if small:  # index scores a query at a time
                part.score_bytes = 1
    cache = model.make_cache()  # type: ignore[attr-defined]
    outs, pos = [], 0
    for size in chunks:
        outs.append(model(mx.array([TOKENS[pos : pos + size]]), cache))  # type: ignore[operator]
        pos += size
    logits = mx.concatenate(outs, axis=1)
    mx.eval(logits)
    return np.asarray(logits)


@pytest.mark.parametrize("small", [False, True], ids=["one group", "many groups"])
def test_a_chunked_prefill_gives_the_masked_logits(small: bool) -> None:
    model = tiny_v4(seed=5)
    chunks = [5, 1, 37, 9, 2, 106]  # picks from position 19 on, HCA entries every 16
    masked = _logits(model, chunks, blocked=False, small=small)
    blocked = _logits(model, chunks, blocked=True, small=small)
    np.testing.assert_allclose(blocked, masked, atol=1e-5, rtol=1e-5)
    assert (blocked.argmax(-1) == masked.argmax(-1)).all()
