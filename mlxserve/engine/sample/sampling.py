"""Token sampling with a per-request random key, so a seed reproduces a completion.

The probability vector is explicit (not only a sampled token) because
speculative rejection sampling compares the draft's and the target's.
"""

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from mlxserve.channel.request import SamplingParams


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution a token is drawn from: softmax(logits / T), then top-p."""
    logprobs = logits.astype(mx.float32) / params.temperature
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    return mx.softmax(logprobs, axis=-1)


def sample(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """One token per row of `logits` ([..., vocab] -> [...]), lazily."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return sample_from(probabilities(logits, params), key)


def sample_from(probs: mx.array, key: mx.array) -> mx.array:
    return mx.random.categorical(mx.log(probs), axis=-1, key=key)


class KeyStream:
    """Successive random keys from one seed (or from entropy when there is none)."""

    def __init__(self, seed: int | None) -> None:
        if seed is None:
            import secrets

            seed = secrets.randbits(63)
        self._key = mx.random.key(seed)

    def next(self) -> mx.array:
        self._key, use = mx.random.split(self._key)
        return use


def token_id(token: mx.array) -> int:
    """A sampled token as a Python int (this waits for the computation)."""
    value = token.item()
    assert isinstance(value, int)
    return value
