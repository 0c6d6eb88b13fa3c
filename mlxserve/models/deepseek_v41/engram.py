"""DeepSeek-V4.1's Engram: an n-gram memory added to the residual streams of a few layers.

Why it exists: V4.1 looks up, for every position, the hashed 2- to ``max_ngram``-grams
that end there in large learned tables, and lets each hyper-connection stream take
the looked-up value in proportion to how well its key matches that stream. A model
that skips it computes different text, so Engram layers are served or refused, never
ignored.

The pieces (DeepSeek's reference, as read through public ports; mlx-vlm's is the
numerical reference in the tests):

* **Token map**: every token id maps to a smaller id space where tokens that normalise
  alike (case, accents, whitespace) share an id (``engram_token_map.json`` in the
  release); the hashes run over those ids.
* **Hashing** (`EngramHasher`): n-gram ``n`` of layer ``l`` at position ``t`` is the XOR
  of ``id[t - i] * m[l, i]`` for ``i < n`` (ids before the start are the pad token's),
  taken modulo one prime per head. The multipliers are odd numbers drawn from numpy's
  ``default_rng(10007 * layer_id)``; the primes are consecutive primes above
  ``engram_vocab_size - 1``, handed out in (layer, n-gram, head) order, and each
  (n-gram, head) owns the bucket range after the previous ones in the layer's table.
* **Lookup and gate** (`Engram`): the rows of all hash columns, concatenated and
  passed through an FP8 round trip (the quantisation the model was trained with), go
  through ``wkv`` to one key per stream and one shared value; each stream adds
  ``sigmoid(g) * value`` where ``g`` is the signed square root of the RMS-normalised
  dot product of stream and key (weighted by ``q_weight * k_weight``, scaled by
  ``hidden_size ** -0.5``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear

FP8_MAX = 448.0
#: the smallest block maximum the FP8 round trip scales by (the reference's floor)
_FP8_AMAX_FLOOR = 1e-4
#: the floor under |score| before its square root
_SCORE_FLOOR = 1e-6
#: the seed of layer ``l``'s multipliers is ``_SEED_STEP * l``
_SEED_STEP = 10007


def fp8_round_trip(x: mx.array, block: int = 32) -> mx.array:
    """``x`` rounded through FP8 e4m3 in blocks of ``block`` with power-of-two scales
    ``2 ** ceil(log2(amax / 448))`` (UE8M0), back in ``x``'s dtype."""
    shape, dtype = x.shape, x.dtype
    blocks = x.astype(mx.float32).reshape(*shape[:-1], shape[-1] // block, block)
    amax = mx.maximum(mx.max(mx.abs(blocks), axis=-1, keepdims=True), _FP8_AMAX_FLOOR)
    # Exact for powers of two: frexp-free, from the float's own exponent and mantissa.
    ratio = amax / FP8_MAX
    bits = ratio.view(mx.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(mx.int32) - 127
    exponent = exponent + ((bits & 0x7FFFFF) != 0).astype(mx.int32)
    scale = mx.power(mx.array(2.0, dtype=mx.float32), exponent.astype(mx.float32))
    codes = mx.to_fp8(mx.clip(blocks / scale, -FP8_MAX, FP8_MAX))
    return (mx.from_fp8(codes, mx.float32) * scale).reshape(shape).astype(dtype)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    factor = 3
    while factor * factor <= n:
        if n % factor == 0:
            return False
        factor += 2
    return True


def _primes_above(start: int, count: int) -> list[int]:
    """The ``count`` smallest primes greater than ``start``."""
    out: list[int] = []
    candidate = start
    while len(out) < count:
        candidate += 1
        if _is_prime(candidate):
            out.append(candidate)
    return out


@dataclass(frozen=True)
class EngramSpec:
    """The hashing layout of a V4.1 config's Engram layers."""

    layer_ids: tuple[int, ...]
    table_rows: tuple[int, ...]
    max_ngram: int
    n_heads: int
    head_dim: int
    vocab_size: int
    compressed_vocab_size: int
    pad_token_id: int

    @property
    def columns(self) -> int:
        """Hash columns per position and layer: one per (n-gram size, head)."""
        return (self.max_ngram - 1) * self.n_heads

    def primes(self) -> np.ndarray:
        """[layers, n-grams, heads] bucket counts (distinct primes, in that order)."""
        flat = _primes_above(self.vocab_size - 1, len(self.layer_ids) * self.columns)
        return np.array(flat, dtype=np.int64).reshape(
            len(self.layer_ids), self.max_ngram - 1, self.n_heads
        )

    def multipliers(self) -> np.ndarray:
        """[layers, max_ngram] odd multipliers, bounded so no product overflows int64."""
        bound = max(1, (np.iinfo(np.int64).max // self.compressed_vocab_size) // 2)
        rows = [
            np.random.default_rng(_SEED_STEP * layer).integers(
                0, bound, size=(self.max_ngram,), dtype=np.int64
            )
            for layer in self.layer_ids
        ]
        return np.stack(rows) * 2 + 1


class EngramHasher:
    """Hash ids of the n-grams ending at each new position, for every Engram layer.

    Stateless: the token history (mapped ids) is passed in and returned, so each
    sequence's cache carries its own.
    """

    def __init__(self, spec: EngramSpec, token_map: Sequence[int]) -> None:
        if max(token_map) + 1 != spec.compressed_vocab_size:
            raise ValueError(
                f"the Engram token map has {max(token_map) + 1} ids; the config says "
                f"engram_compressed_vocab_size {spec.compressed_vocab_size}"
            )
        self.spec = spec
        self.token_map = mx.array(np.asarray(token_map, dtype=np.int64))
        self.pad = int(token_map[spec.pad_token_id])
        primes = spec.primes()
        self.primes = mx.array(primes)
        flat = primes.reshape(len(spec.layer_ids), -1)
        self.offsets = mx.array(np.cumsum(flat, axis=1) - flat)
        self.multipliers = mx.array(spec.multipliers())

    def __call__(self, tokens: mx.array, history: mx.array | None) -> tuple[mx.array, mx.array]:
        """``tokens`` [B, L] after ``history`` [B, H] (mapped ids, or None): returns
        the hash ids [B, L, layers, columns] and the new history (the last
        ``max_ngram - 1`` mapped ids suffice)."""
        batch, length = tokens.shape
        keep = self.spec.max_ngram - 1
        mapped = self.token_map[tokens]
        if history is None:
            history = mx.full((batch, 0), self.pad, dtype=mx.int64)
        known = history.shape[1]
        pad = mx.full((batch, keep), self.pad, dtype=mx.int64)
        # Shift i of position t reads id t - i, the pad token before the start.
        line = mx.concatenate([pad, history, mapped], axis=1)
        start = keep + known
        acc: mx.array | None = None
        hashes = []
        for shift in range(self.spec.max_ngram):
            ids = line[:, start - shift : start - shift + length]
            term = ids[:, :, None] * self.multipliers[None, None, :, shift]
            acc = term if acc is None else mx.bitwise_xor(acc, term)
            if shift:
                hashes.append(acc[..., None] % self.primes[None, None, :, shift - 1])
        ids = mx.concatenate(hashes, axis=-1) + self.offsets
        return ids, line[:, -keep:] if keep else line[:, :0]


class Engram(Module):
    """One layer's Engram; parameter names follow DeepSeek's checkpoint
    (``layers.N.engram.{embed.weight, wkv.weight, q_weight, k_weight}``)."""

    def __init__(
        self, spec: EngramSpec, layer_id: int, hidden_size: int, hc_mult: int, eps: float
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.slot = spec.layer_ids.index(layer_id)
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.eps = eps
        self.embed = Embedding(spec.table_rows[self.slot], spec.head_dim)
        self.wkv = Linear(spec.columns * spec.head_dim, hidden_size * (hc_mult + 1), bias=False)
        self.q_weight = mx.ones((hc_mult, hidden_size))
        self.k_weight = mx.ones((hc_mult, hidden_size))

    def __call__(self, streams: mx.array, hash_ids: mx.array) -> mx.array:
        """``streams`` [B, L, hc, D] plus this layer's gated lookup (``hash_ids`` [B, L, cols])."""
        rows = self.embed(hash_ids).astype(streams.dtype)
        rows = rows.reshape(*hash_ids.shape[:-1], -1)
        kv = self.wkv(fp8_round_trip(rows))
        key = kv[..., : self.hc_mult * self.hidden_size].reshape(
            *kv.shape[:-1], self.hc_mult, self.hidden_size
        )
        value = kv[..., self.hc_mult * self.hidden_size :]
        h = streams.astype(mx.float32)
        k = key.astype(mx.float32)
        weight = self.q_weight.astype(mx.float32) * self.k_weight.astype(mx.float32)
        inv_h = mx.rsqrt(mx.mean(h * h, axis=-1) + self.eps)
        inv_k = mx.rsqrt(mx.mean(k * k, axis=-1) + self.eps)
        dot = mx.sum(h * weight * k, axis=-1) * inv_h * inv_k * (self.hidden_size**-0.5)
        score = mx.sign(dot) * mx.sqrt(mx.maximum(mx.abs(dot), _SCORE_FLOOR))
        score = mx.where(dot == 0, mx.sqrt(mx.array(_SCORE_FLOOR)), score)
        gate = mx.sigmoid(score)
        out = h + gate[..., None] * value.astype(mx.float32)[:, :, None, :]
        return out.astype(streams.dtype)
