"""DeepSeek-V4.1's rollback cache: a verify forward, then a trim of its rejected tail,
decodes exactly as if the rejected tokens had never been fed.

Across the cases the trim reopens closed compressed groups (ratio 4), cuts a ratio-1
compressor's entries, shortens the sliding window past its width, and drops Engram
history; the reference is a fresh forward of the kept sequence.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlxserve.models.deepseek_v41.cache import LayerCache
from mlxserve.models.deepseek_v41.model import Model, ModelArgs
from tests.models.v41_fixtures import config, random_v41

VERIFY = 5
SEQUENCE = [(37 * i + 11) % 1000 for i in range(64)]


def _model(variant: str) -> Model:
    if variant != "ratio-1 source":
        return random_v41(engram=variant == "engram", seed=3)
    raw = config(engram=False)
    raw["text_config"].update(
        kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3], compress_ratios=[0, 4, 4, 1]
    )
    model = Model(ModelArgs.from_dict(raw))
    mx.random.seed(4)
    model.update(_random_like(model.parameters()))
    return model


def _random_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _random_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_random_like(v) for v in tree]
    return 0.1 * mx.random.normal(tree.shape) + (1.0 if tree.ndim == 1 else 0.0)


@pytest.mark.parametrize("variant", ["plain", "engram", "ratio-1 source"])
@pytest.mark.parametrize("prefix", [13, 18])
def test_a_trimmed_verify_decodes_as_if_the_rejected_tokens_never_came(
    variant: str, prefix: int
) -> None:
    model = _model(variant)
    verify = [(5 * i + 900) % 1000 for i in range(VERIFY)]  # tokens the sequence never has
    follow = SEQUENCE[prefix : prefix + 3]
    for rejected in (1, 3, VERIFY - 1):
        cache = model.make_cache(max_rollback=VERIFY)
        model(mx.array([SEQUENCE[:prefix]]), cache=cache)
        model(mx.array([verify]), cache=cache)
        for layer in cache:
            assert layer.trim(rejected) == rejected
        kept = [*SEQUENCE[:prefix], *verify[: VERIFY - rejected]]
        assert cache[0].offset == len(kept)
        fresh = model(mx.array([[*kept, *follow]]))[0, len(kept) :]
        for i, token in enumerate(follow):  # decode steps after the trim
            step = model(mx.array([[token]]), cache=cache)[0, -1]
            assert mx.abs(step - fresh[i]).max().item() <= 1e-4, (variant, prefix, rejected, i)


def test_a_trim_beyond_the_margin_is_refused_and_no_margin_is_not_trimmable() -> None:
    model = random_v41(engram=False)
    cache = model.make_cache(max_rollback=2)
    model(mx.array([SEQUENCE[:20]]), cache=cache)
    assert all(layer.is_trimmable() for layer in cache)
    with pytest.raises(ValueError, match="margin is 2"):
        cache[1].trim(3)
    assert not LayerCache(16).is_trimmable()


def test_compact_keeps_what_the_cache_holds() -> None:
    model = random_v41(engram=True)
    cache = model.make_cache(max_rollback=4)
    model(mx.array([SEQUENCE[:21]]), cache=cache)
    before = [[mx.array(a) for a in layer.state] for layer in cache]
    for layer in cache:
        layer.compact()
    for layer, arrays in zip(cache, before, strict=True):
        assert len(layer.state) == len(arrays)
        assert all(mx.array_equal(a, b).item() for a, b in zip(layer.state, arrays, strict=True))
    logits = model(mx.array([SEQUENCE[21:22]]), cache=cache)[0, -1]
    fresh = model(mx.array([SEQUENCE[:22]]))[0, -1]
    assert mx.abs(logits - fresh).max().item() <= 1e-4
