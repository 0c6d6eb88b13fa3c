"""Token sampling with per-request random keys, so a seed reproduces a completion.

A request's randomness is keyed by position: the token at position p of its answer
is drawn with the key of (seed, p), the same whichever step draws it (alone or in a
batch, a plain step or a speculative round's verify), so what a seed gives depends
neither on the batch, nor on `max_tokens`, nor on the speculative depth. A draw is
the Gumbel-max trick, ``argmax(log_weights + G)`` with G the Gumbel noise of that
key: a speculative round drafts position p with the same noise as its verify
(`Draws.coupled`), so a kept draft is exactly the token a plain step would draw.

The probability vector is explicit (not only a sampled token) because
speculative rejection sampling compares the draft's and the target's.
"""

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from mlxserve.channel.request import SamplingParams

_BITS = (1 << 64) - 1


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """The distribution a token is drawn from: softmax(logits / T), then top-p."""
    logprobs = logits.astype(mx.float32) / params.temperature
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    return mx.softmax(logprobs, axis=-1)


def sample(logits: mx.array, params: SamplingParams, key: mx.array) -> mx.array:
    """One token from ``logits`` ([vocab] -> []), lazily."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return sample_from(probabilities(logits, params), key)


def sample_from(probs: mx.array, key: mx.array) -> mx.array:
    return pick(mx.log(probs), key)


def pick(log_weights: mx.array, key: mx.array) -> mx.array:
    """A token drawn from ``log_weights`` ([..., vocab], unnormalised; -inf: never) with
    ``key``: ``argmax(log_weights + G)``, G the key's Gumbel noise over the vocabulary
    (the same noise for every row: one position's)."""
    noise = mx.random.gumbel(shape=log_weights.shape[-1:], key=key)
    return mx.argmax(log_weights.astype(mx.float32) + noise, axis=-1)


def pick_rows(log_weights: mx.array, keys: Sequence[mx.array]) -> mx.array:
    """`pick` for each row of ``log_weights`` [n, vocab] with its own key: row i's token
    is the one `pick` gives for that row alone with ``keys[i]``."""
    vocab = log_weights.shape[-1:]
    noise = mx.stack([mx.random.gumbel(shape=vocab, key=key) for key in keys])
    return mx.argmax(log_weights.astype(mx.float32) + noise, axis=-1)


def _mix(value: int) -> int:
    """splitmix64's finaliser: 64 well-mixed bits of ``value``."""
    value = (value + 0x9E3779B97F4A7C15) & _BITS
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _BITS
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _BITS
    return value ^ (value >> 31)


class KeyStream:
    """A request's random keys: one per (position, use), from its seed (or from
    entropy when there is none).

    ``coupled`` (by default: when there is a seed): its speculative rounds keep a draft
    only where it is the token a plain step would draw at that position (`Draws`), so
    the answer does not depend on the depth; otherwise they use rejection sampling
    (more drafts kept, the same distribution, but other tokens than depth 0's)."""

    def __init__(self, seed: int | None, coupled: bool | None = None) -> None:
        self.coupled = seed is not None if coupled is None else coupled
        self.seed = secrets.randbits(63) if seed is None else seed

    def key(self, position: int, use: int = 0) -> mx.array:
        """The key of the token at ``position`` (0: the answer's first); ``use`` > 0 keys
        the other draws of a round that starts there (`mlxserve.engine.sample.acceptance`)."""
        return mx.random.key(_mix(_mix(_mix(self.seed & _BITS) ^ position) ^ use))

    def at(self, position: int) -> "Draws":
        return Draws(self, position)


@dataclass(frozen=True)
class Draws:
    """The keys of a request's positions from ``start`` on: what one step or one
    speculative round (drafts at ``start``, ``start + 1``, ...) draws with."""

    keys: KeyStream
    start: int

    @property
    def coupled(self) -> bool:
        return self.keys.coupled

    def key(self, offset: int, use: int = 0) -> mx.array:
        return self.keys.key(self.start + offset, use)

    def pick(self, log_weights: mx.array) -> mx.array:
        """`pick_rows` of ``log_weights`` [n, vocab], row j with position ``start + j``'s
        key: the tokens plain steps would draw there from these weights."""
        return pick_rows(log_weights, [self.key(j) for j in range(int(log_weights.shape[0]))])


def token_id(token: mx.array) -> int:
    """A sampled token as a Python int (this waits for the computation)."""
    value = token.item()
    assert isinstance(value, int)
    return value
