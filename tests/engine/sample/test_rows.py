"""A decode batch's rows sampled in one graph draw exactly the tokens each row draws
alone (`sample`), by seed: greedy rows, temperatures, top-p rows, every logits dtype."""

import random

import mlx.core as mx
import pytest

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.sample.rows import sample_rows
from mlxserve.engine.sample.sampling import KeyStream, sample

DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def _alone(logits: mx.array, params: list[SamplingParams], keys: list[mx.array]) -> list[int]:
    return [int(sample(logits[i], params[i], keys[i]).item()) for i in range(len(params))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_draw_what_they_draw_alone(dtype: mx.Dtype) -> None:
    chooser = random.Random(5)
    mx.random.seed(5)
    for _ in range(20):
        rows = chooser.choice([1, 2, 5, 16])
        vocab = chooser.choice([7, 97, 1024])
        scale = chooser.choice([0.1, 1.0, 8.0])
        logits = (mx.random.normal((rows, vocab)) * scale).astype(dtype)
        params = [
            SamplingParams(
                temperature=chooser.choice([0.0, 0.5, 1.0, 1.7]),
                top_p=chooser.choice([1.0, 1.0, 0.8]),
            )
            for _ in range(rows)
        ]
        keys = [KeyStream(chooser.randrange(1 << 63)).key(chooser.randrange(64)) for _ in params]
        assert sample_rows(logits, params, keys).tolist() == _alone(logits, params, keys)


def test_all_greedy_rows_take_the_argmax() -> None:
    logits = mx.array([[0.0, 3.0, 1.0], [5.0, 1.0, 2.0]])
    keys = [KeyStream(1).key(0), KeyStream(2).key(0)]
    assert sample_rows(logits, [SamplingParams(), SamplingParams()], keys).tolist() == [1, 0]


def test_a_row_s_draw_depends_on_its_own_key_only() -> None:
    """The same row with the same key draws the same token whatever its neighbours."""
    mx.random.seed(0)
    logits = mx.random.normal((4, 97))
    params = [SamplingParams(temperature=1.0)] * 4
    keys = [KeyStream(seed).key(3) for seed in (10, 11, 12, 13)]
    together = sample_rows(logits, params, keys).tolist()
    for i in range(4):
        assert sample_rows(logits[i : i + 1], params[i : i + 1], keys[i : i + 1]).tolist() == [
            together[i]
        ]
