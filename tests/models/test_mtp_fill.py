"""``mtp_fill`` leaves exactly the MTP cache that ``mtp_forward`` leaves.

The engine makes the MTP entries of decoded positions with ``mtp_fill`` (the block's
input and its K=V rows only), where it ran the whole block before: the drafts read
those caches, so they must be the same arrays, bit for bit, for one sequence and for a
batch of rows at different offsets, from position 0 on and with a rollback margin.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.models import load
from mlxserve.models.deepseek_v4.cache import LayerCache, RowCaches


@pytest.fixture(scope="module")
def model() -> Any:
    loaded, _ = load("demo")
    return loaded


def _inputs(model: Any, rows: int, length: int, seed: int) -> tuple[mx.array, mx.array]:
    """Random main-model streams [rows, length, hc, D] and the tokens that follow them."""
    key = mx.random.key(seed)
    hc, hidden = model.args.hc_mult, model.args.hidden_size
    streams = mx.random.normal((rows, length, hc, hidden), key=key)
    tokens = mx.random.randint(0, model.args.vocab_size, (rows, length), key=key)
    return streams, tokens


def _same(a: LayerCache, b: LayerCache) -> None:
    assert a.offset == b.offset
    assert len(a.state) == len(b.state)
    for x, y in zip(a.state, b.state, strict=True):
        assert x.shape == y.shape
        np.testing.assert_array_equal(np.array(x), np.array(y))


def _fresh(model: Any, rollback: int) -> LayerCache:
    cache: LayerCache = model.make_mtp_cache(max_rollback=rollback)[0]
    return cache


@pytest.mark.parametrize("rollback", [0, 5])
def test_one_sequence_in_chunks(model: Any, rollback: int) -> None:
    """From position 0 (the zeroed embedding) past the sliding window, in uneven chunks."""
    full, filled = _fresh(model, rollback), _fresh(model, rollback)
    streams, tokens = _inputs(model, 1, 50, seed=1)
    start = 0
    for size in (7, 1, 30, 2, 10):
        part = streams[:, start : start + size], tokens[:, start : start + size]
        model.mtp_forward(*part, full, 0)
        model.mtp_fill(*part, filled, 0)
        start += size
        mx.eval(full.state, filled.state)
        _same(full, filled)


def test_rows_at_different_offsets(model: Any) -> None:
    """A batch's backlog: rows at their own offsets (one still at 0), several steps each."""
    lengths = [0, 3, 40]
    full = [_fresh(model, 5) for _ in lengths]
    filled = [_fresh(model, 5) for _ in lengths]
    for i, length in enumerate(lengths):
        if length:
            streams, tokens = _inputs(model, 1, length, seed=10 + i)
            for caches in (full, filled):
                model.mtp_forward(streams, tokens, caches[i], 0)
    streams, tokens = _inputs(model, len(lengths), 4, seed=2)
    model.mtp_forward(streams, tokens, RowCaches(full), 0)
    model.mtp_fill(streams, tokens, RowCaches(filled), 0)
    mx.eval([c.state for c in (*full, *filled)])
    for a, b in zip(full, filled, strict=True):
        _same(a, b)


def test_trim_after_fill_matches(model: Any) -> None:
    """Filled entries roll back like forwarded ones (the batch trims rejected drafts)."""
    full, filled = _fresh(model, 5), _fresh(model, 5)
    streams, tokens = _inputs(model, 1, 40, seed=3)
    model.mtp_forward(streams, tokens, full, 0)
    model.mtp_fill(streams, tokens, filled, 0)
    assert full.trim(3) == filled.trim(3) == 3
    more = _inputs(model, 1, 2, seed=4)
    model.mtp_forward(*more, full, 0)
    model.mtp_fill(*more, filled, 0)
    mx.eval(full.state, filled.state)
    _same(full, filled)


def test_a_cache_for_each_row(model: Any) -> None:
    streams, tokens = _inputs(model, 2, 3, seed=5)
    with pytest.raises(ValueError, match="2 rows"):
        model.mtp_fill(streams, tokens, RowCaches([_fresh(model, 0)]), 0)
