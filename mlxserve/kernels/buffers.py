"""Arrays in buffers of their own size, for state kept long (the prefix cache).

MLX's evaluated slices share their source's whole buffer: a cache window cut from
the step's concatenation, or a row's part of a stacked batch, keeps all of it alive
for as long as the slice is kept, and so does an unevaluated copy of it (its graph
holds the source). Measured on the demo with 8 requests decoding together: 16
prefix-cache entries counting 398 KB held 1.96 MB, because a row leaving the stacked
batch was given ``mx.array`` of its slice and nothing evaluated it before the prefix
cache kept the row. ``mx.contiguous`` is no copy either: it returns a slice within
16 KB of its buffer as the slice.

`owned` is a product with fresh ones: MLX gives its output the ones' buffer (the
input is still referenced, so it is not donated), exactly the output's size, and
``x * 1`` is ``x`` (NaN payloads aside, which stay NaN). It is lazy, so copies of a
whole layer's arrays evaluate together: `evaluate` them before the source is dropped.
"""

from collections.abc import Iterable

import mlx.core as mx


def owned(array: mx.array) -> mx.array:
    """A copy of ``array`` that will have a buffer of exactly its size (lazy)."""
    return array * mx.ones_like(array)


def own_buffers(arrays: Iterable[mx.array]) -> list[mx.array]:
    """Copies of ``arrays`` in buffers of their own size, evaluated together."""
    copies = [owned(array) for array in arrays]
    mx.eval(copies)
    return copies
