"""Attention over a few queries, one unmasked call per query (CUDA's choice) or one
masked call (Metal's and the CPU's): both must give the same logits, at every
alignment of the window, of entries closing inside the forward and of the indexer's
picks (``mlxserve.kernels.attention``)."""

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from mlxserve.kernels import attention
from mlxserve.models.deepseek_v4 import Model
from tests.engine.v4_models import tiny_v4

TOKENS = [(7 * i + 3) % 61 for i in range(56)]


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_v4(seed=3)


@pytest.fixture
def split_setting() -> Iterator[None]:
    yield
    attention.SPLIT_QUERIES = None


def _chunked_logits(model: Model, prefix: int, length: int, split: bool) -> np.ndarray:
    """Logits of TOKENS: a prefill of `prefix` tokens, then forwards of `length`."""
    attention.SPLIT_QUERIES = split
    cache = model.make_cache()
    outs = [model(mx.array([TOKENS[:prefix]]), cache)]
    for first in range(prefix, len(TOKENS), length):
        outs.append(model(mx.array([TOKENS[first : first + length]]), cache))
    logits = mx.concatenate(outs, axis=1)
    mx.eval(logits)
    return np.asarray(logits)


@pytest.mark.parametrize(("prefix", "length"), [(1, 2), (2, 3), (5, 6), (3, 8), (14, 5)])
def test_one_call_per_query_matches_the_masked_call(
    model: Model, split_setting: None, prefix: int, length: int
) -> None:
    # 56 tokens: the window of 8 fills, CSA entries (ratio 4) pass index_topk = 4 at
    # position 19 and HCA (ratio 16) closes three, many of them inside a forward.
    split = _chunked_logits(model, prefix, length, split=True)
    masked = _chunked_logits(model, prefix, length, split=False)
    whole = _chunked_logits(model, len(TOKENS), 1, split=False)
    np.testing.assert_allclose(split, masked, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(split, whole, atol=2e-5, rtol=1e-5)


def test_only_few_query_forwards_are_split(split_setting: None) -> None:
    attention.SPLIT_QUERIES = True
    assert not attention.split_queries(1)
    assert attention.split_queries(2) and attention.split_queries(attention.MAX_SPLIT_QUERIES)
    assert not attention.split_queries(attention.MAX_SPLIT_QUERIES + 1)
    attention.SPLIT_QUERIES = None
    assert not attention.split_queries(2)  # this CPU keeps the masked call
