"""The switch layer class behind each ``nax_moe`` variant.

A variant is applied by setting the ``__class__`` of mlx-lm's
``QuantizedSwitchLinear`` instances: the weights stay where they are (same
module, same arrays), ``isinstance(layer, QuantizedSwitchLinear)`` still holds
for mlx-lm's sharding, LoRA and dequantize helpers, and setting the class back
restores stock behaviour exactly. Hence the subclass carries no state of its own.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from .moe import MoeVariant, QuantizedExperts, full_matmul


class FullComputeSwitchLinear(QuantizedSwitchLinear):
    """``QuantizedSwitchLinear`` that never runs ``gather_qmm`` with sorted indices.

    Same inputs, outputs and parameters as the stock layer; sorted batches run
    through `full_matmul`'s expert-aligned tiles instead of ``gather_qmm_rhs_nax``.
    Sorted batches read the tile count back to the host, so they cannot run inside
    ``mx.compile`` (mlx-lm does not compile model forwards).
    """

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = full_matmul(QuantizedExperts.of(self), x, indices, sorted_indices=sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


VARIANT_CLASSES: dict[MoeVariant, type[QuantizedSwitchLinear]] = {
    "skip": QuantizedSwitchLinear,
    "full": FullComputeSwitchLinear,
    "off": QuantizedSwitchLinear,
}
"""``skip`` and ``off`` both mean the stock layer: on a NAX rank with mlx >= 0.32.2
its sorted call *is* the #4352 kernel, and on a rank without NAX it never meets it."""

SWAPPABLE: frozenset[type[QuantizedSwitchLinear]] = frozenset(VARIANT_CLASSES.values())
"""Classes whose instances may be switched; other subclasses keep their own ``__call__``."""
