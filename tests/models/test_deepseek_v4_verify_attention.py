"""Attention over a few queries, one unmasked call per query (CUDA's choice) or one
masked call (Metal's and the CPU's): both must give the same logits, at every
alignment of the window, of entries closing inside the forward and of the indexer's
picks, after rollbacks and for rows at different offsets
(``mlxserve.kernels.attention``)."""

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.hardware.device import on_cuda
from mlxserve.hardware.tuning import default_tuning
from mlxserve.kernels import attention
from mlxserve.models.deepseek_v4 import Model
from mlxserve.models.deepseek_v4.cache import RowCaches
from tests.engine.v4_models import tiny_v4

# 56 tokens: the window of 8 fills, CSA entries (ratio 4) pass index_topk = 4 at
# position 19 and HCA (ratio 16) closes three, many of them inside a forward.
TOKENS = [(7 * i + 3) % 61 for i in range(56)]


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_v4(seed=3)


@pytest.fixture(autouse=True)
def _device_tuning(model: Model) -> Iterator[None]:
    """Each test leaves the shared model as it found it: tuned for this device."""
    yield
    model.tune(default_tuning())


def _split(model: Model, on: bool) -> None:
    model.tune(default_tuning().replace(split_attention_queries=on))


@pytest.fixture(scope="module")
def whole(model: Model) -> np.ndarray:
    """TOKENS' logits from one masked prefill."""
    logits = model(mx.array([TOKENS]), model.make_cache())
    mx.eval(logits)
    return np.asarray(logits)


def _chunked_logits(model: Model, prefix: int, length: int, rejected: int = 0) -> np.ndarray:
    """Logits of TOKENS: a prefill of `prefix` tokens, then forwards of `length`, each
    followed by `length - 1` made-up ones that are rolled back (a rejected verify)."""
    cache = model.make_cache(max_rollback=8) if rejected else model.make_cache()
    outs = [model(mx.array([TOKENS[:prefix]]), cache)]
    for first in range(prefix, len(TOKENS), length):
        chunk = TOKENS[first : first + length]
        outs.append(model(mx.array([chunk]), cache))
        if rejected and len(chunk) == length:
            model(mx.array([[(5 * t + 1) % 61 for t in range(rejected)]]), cache)
            for layer_cache in cache:
                assert layer_cache.trim(rejected) == rejected
    logits = mx.concatenate(outs, axis=1)
    mx.eval(logits)
    return np.asarray(logits)


@pytest.mark.parametrize(
    ("prefix", "length", "rejected"),
    [(1, 2, 0), (2, 3, 0), (5, 6, 0), (3, 8, 0), (14, 5, 0), (4, 3, 2), (9, 6, 5)],
)
def test_one_call_per_query_matches_the_masked_call(
    model: Model,
    whole: np.ndarray,
    prefix: int,
    length: int,
    rejected: int,
) -> None:
    _split(model, True)
    split = _chunked_logits(model, prefix, length, rejected)
    _split(model, False)
    masked = _chunked_logits(model, prefix, length, rejected)
    np.testing.assert_allclose(split, masked, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(split, whole, atol=2e-5, rtol=1e-5)


def test_rows_at_different_offsets_split_alike(model: Model) -> None:
    # Row 0 at 23 (picks), row 1 at 11 (no picks yet): a batched verify of 3 tokens.
    def verify() -> np.ndarray:
        rows = [model.make_cache(), model.make_cache()]
        for cache, length in zip(rows, (23, 11), strict=True):
            mx.eval(model(mx.array([TOKENS[:length]]), cache))
        layers = [RowCaches(list(layer)) for layer in zip(*rows, strict=True)]
        logits = model(mx.array([TOKENS[23:26], TOKENS[11:14]]), layers)
        mx.eval(logits)
        return np.asarray(logits)

    _split(model, True)
    split = verify()
    _split(model, False)
    np.testing.assert_allclose(split, verify(), atol=2e-5, rtol=1e-5)


def test_only_few_query_forwards_are_split() -> None:
    assert not attention.split_queries(1, True)
    assert attention.split_queries(2, True)
    assert attention.split_queries(attention.MAX_SPLIT_QUERIES, True)
    assert not attention.split_queries(attention.MAX_SPLIT_QUERIES + 1, True)
    assert not attention.split_queries(2, False)
    assert default_tuning().split_attention_queries == on_cuda()  # chosen by device


def test_the_tuning_reaches_every_attention_layer(model: Model) -> None:
    for on in (True, False):
        _split(model, on)
        layers = [*model.layers, *model.mtp]
        assert {layer.attn.split_attention_queries for layer in layers} == {on}
