"""A forward queued for the device every few layers computes exactly the same."""

import mlx.core as mx
import pytest

from tests.engine.v4_models import tiny_v4


@pytest.mark.parametrize("queue_every", [1, 2])
@pytest.mark.parametrize("length", [1, 4])
def test_queued_forward_equals_the_plain_one(queue_every: int, length: int) -> None:
    model = tiny_v4(seed=3)
    prompt = mx.array([[(7 * i + 2) % 61 for i in range(19)]])
    plain_cache, queued_cache = model.make_cache(4), model.make_cache(4)
    model.forward_hidden(prompt, plain_cache)
    model.forward_hidden(prompt, queued_cache)
    tokens = mx.array([[(5 * i + 1) % 61 for i in range(length)]])
    plain = model.forward_hidden(tokens, plain_cache)
    queued = model.forward_hidden(tokens, queued_cache, queue_every=queue_every)
    assert mx.array_equal(plain, queued)
    for a, b in zip(plain_cache, queued_cache, strict=True):
        assert a.offset == b.offset
        assert all(mx.array_equal(x, y) for x, y in zip(a.state, b.state, strict=True))
