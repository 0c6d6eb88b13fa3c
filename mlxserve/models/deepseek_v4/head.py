"""The vocabulary head's product, in float32, without a float32 copy of the whole head.

DeepSeek-V4's final RMSNorm keeps float32 weights (as the reference does), so the
activations reaching ``lm_head`` are float32 while the head itself is bfloat16
(129,280 x 4,096 in V4-Flash, 1.06 GB). MLX promotes a mixed matmul to float32 by
casting the *weight*: every decode step made a 2.1 GB float32 copy of the head (the
peak of a 100K first step on one real-width layer was 2.1 GB above the weights and
the cache) and read it again.

MLX has no bfloat16 matmul with a float32 result (its output takes the operands'
dtype), so splitting the activations into bfloat16 high and low parts and doing one
bfloat16 matmul rounds every logit to bfloat16: on a random 129,280 x 4,096 head,
8e-3 off at logits of 4 and 6e-2 at 19, and one greedy token of four changed.
Instead the product runs over slices of the vocabulary: each slice of rows is cast
and multiplied on its own, every logit the same float32 dot product as before. Each
slice waits for the previous one's product (``mx.depends``): without it MLX
schedules every cast before the first product and the whole float32 copy exists
again. The backend still allocates a few slices ahead of its work (about 17 on this
CPU), so the transient is about 17 slices, not one: 570 MB instead of 2.1 GB at the
default 32 MiB slices. What it does not remove: the head's bytes are still read,
written as float32 and read again each step, and a GPU launches two kernels per
slice (128 for V4-Flash). On CUDA a kernel that reads the bfloat16 rows into
float32 sums (``mlxserve.kernels.head_product``) removes both for up to 16 rows,
where it checks out against the CPU's float32 product. Quantised heads
(``QuantizedLinear``, ``QuantizedEmbedding``) never needed any of it: their kernel
dequantises in place.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding

from mlxserve.kernels import head_product as head_kernel

#: Bytes of float32 weight rows one slice of the head's product may hold (32 MiB:
#: 2,048 rows at hidden 4,096, 64 slices for V4-Flash's vocabulary). Smaller slices
#: hold less at once and launch more kernels (two per slice).
SLICE_BYTES = 32 << 20


def _float_weight(layer: Module) -> mx.array | None:
    """The plain float weight of a bias-free ``Linear`` or an ``Embedding`` (its rows
    are the head's), else None (quantised layers, biases: the layer's own call)."""
    if type(layer) not in (Linear, Embedding) or "bias" in layer:
        return None
    weight: mx.array = layer["weight"]
    return weight if mx.issubdtype(weight.dtype, mx.floating) else None


def sliced_product(h: mx.array, weight: mx.array, slice_bytes: int = SLICE_BYTES) -> mx.array:
    """``h @ weight.T`` in float32 (``h`` float32), casting ``weight`` [V, D] a slice of
    rows at a time (at most ``slice_bytes`` of float32 rows each), each slice after the
    previous one's product; one product when it fits."""
    vocab, dim = weight.shape
    rows = max(1, slice_bytes // (4 * dim))
    if rows >= vocab:
        whole: mx.array = h @ weight.astype(mx.float32).T
        return whole
    parts: list[mx.array] = []
    for a in range(0, vocab, rows):
        rows_a = weight[a : a + rows]
        if parts:  # after the previous slice's product (the module docstring)
            rows_a = mx.depends(rows_a, parts[-1])
        parts.append(h @ rows_a.astype(mx.float32).T)
    return mx.concatenate(parts, axis=-1)


def head_logits(layer: Module, h: mx.array, slice_bytes: int = SLICE_BYTES) -> mx.array:
    """Logits of ``h`` through ``layer`` (an ``lm_head`` ``Linear``, or a tied
    ``Embedding`` used as one): float32 activations meeting a narrower float head go
    through the CUDA kernel where it takes them (``kernels.head_product``), else
    `sliced_product`; everything else is the layer's own call."""
    weight = _float_weight(layer)
    if weight is not None and h.dtype == mx.float32 and weight.dtype != mx.float32:
        if (
            head_kernel.available()
            and head_kernel.fits(h, weight)
            and head_kernel.agrees(weight.dtype, weight.shape[-1])
        ):
            return head_kernel.product(h, weight)
        return sliced_product(h, weight, slice_bytes)
    if isinstance(layer, Embedding | QuantizedEmbedding):
        tied: mx.array = layer.as_linear(h)  # type: ignore[no-untyped-call]
        return tied
    out: mx.array = layer(h)
    return out
