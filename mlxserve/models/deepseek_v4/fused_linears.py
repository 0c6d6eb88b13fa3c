"""Several projections of one input as one matmul, for the decode path's node count.

A decode step is bound by the kernels it launches (docs/engine.md, "Ops per decode
step"), and several of a DeepSeek-V4 layer's projections read the same input: the
shared expert's ``gate_proj`` and ``up_proj``, a compressor's ``wkv`` and ``wgate``,
the attention's ``wq_a`` and ``wkv``. `FusedLinears` concatenates their weights along
the output rows once, so one matmul computes them all, and hands out each
projection's columns of its output as a view.

The layers keep working on their own: each layer's ``weight`` (``scales``,
``biases``) is re-pointed to its rows of the concatenated array, a slice that shares
its buffer, so nothing is held twice, every other path (a prefill, the plain ops,
saving, sharding) sees the same values, and a later load or shard that replaces a
layer's arrays is noticed (`FusedLinears.fresh`) and the concatenation is made again.

Only layers of one kind concatenate: float ``Linear`` layers without a bias of one
dtype, or ``QuantizedLinear`` layers of one mode, group size and bit width without a
bias. Each output column is the same dot product of the same rows as the separate
matmul's; only the order a kernel sums in, which may depend on the matmul's width,
can differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedLinear

#: The arrays of a layer that are concatenated, by kind.
_FLOAT_KEYS = ("weight",)


def _keys(layer: Module) -> tuple[str, ...]:
    return ("weight", "scales", "biases") if "biases" in layer else ("weight", "scales")


def _kind(layer: Module) -> tuple[object, ...] | None:
    """What must match for layers to concatenate, or None for a layer that does not."""
    if "bias" in layer:
        return None
    if type(layer) is Linear:
        return ("float", layer["weight"].dtype, layer["weight"].shape[-1])
    if type(layer) is QuantizedLinear:
        weight = layer["weight"]
        return (
            "quantized",
            layer.mode,
            layer.group_size,
            layer.bits,
            weight.shape[-1],
            _keys(layer),
        )
    return None


class FusedLinears:
    """The concatenation of ``layers``' weights (module docstring)."""

    def __init__(self, layers: Sequence[Module]) -> None:
        first = layers[0]
        self.quantized = isinstance(first, QuantizedLinear)
        keys = _keys(first) if self.quantized else _FLOAT_KEYS
        rows = [int(layer["weight"].shape[0]) for layer in layers]
        self.bounds = [sum(rows[:i]) for i in range(len(rows) + 1)]
        self.arrays = {key: mx.concatenate([layer[key] for layer in layers]) for key in keys}
        mx.eval(self.arrays)
        self.parts: list[dict[str, mx.array]] = []
        for layer, start, stop in zip(layers, self.bounds, self.bounds[1:], strict=False):
            part = {key: array[start:stop] for key, array in self.arrays.items()}
            mx.eval(part)
            layer.update(part)
            self.parts.append(part)
        self.layer = first

    def fresh(self, layers: Sequence[Module]) -> bool:
        """Whether ``layers`` still hold exactly the rows handed out (nothing loaded,
        sharded or quantised since)."""
        return len(layers) == len(self.parts) and all(
            all(key in layer and layer[key] is array for key, array in part.items())
            for layer, part in zip(layers, self.parts, strict=True)
        )

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each layer's output for ``x``: views of the one matmul's columns."""
        if self.quantized:
            layer = self.layer
            out = mx.quantized_matmul(
                x,
                self.arrays["weight"],
                scales=self.arrays["scales"],
                biases=self.arrays.get("biases"),
                transpose=True,
                group_size=layer.group_size,
                bits=layer.bits,
                mode=layer.mode,
            )
        else:
            out = x @ self.arrays["weight"].T
        return [out[..., a:b] for a, b in zip(self.bounds, self.bounds[1:], strict=False)]


class Projections:
    """Projections of one input: the layers of each kind that concatenate as one
    `FusedLinears`, any other layer called on its own."""

    def __init__(self, layers: Sequence[Module]) -> None:
        self.layers = list(layers)
        by_kind: dict[tuple[object, ...], list[int]] = {}
        for index, layer in enumerate(layers):
            kind = _kind(layer)
            if kind is not None:
                by_kind.setdefault(kind, []).append(index)
        #: (the layers' positions, their concatenation) for each kind of two or more
        self.groups = [
            (indices, FusedLinears([layers[i] for i in indices]))
            for indices in by_kind.values()
            if len(indices) > 1
        ]

    def fresh(self, layers: Sequence[Module]) -> bool:
        """Whether these are the same layers holding the rows handed out."""
        return (
            len(layers) == len(self.layers)
            and all(a is b for a, b in zip(layers, self.layers, strict=True))
            and all(group.fresh([layers[i] for i in indices]) for indices, group in self.groups)
        )

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each layer's output for ``x``, in the layers' order."""
        outputs: list[mx.array | None] = [None] * len(self.layers)
        for indices, group in self.groups:
            for index, out in zip(indices, group(x), strict=True):
                outputs[index] = out
        return [out if out is not None else self.layers[i](x) for i, out in enumerate(outputs)]


def fused(owner: Module, name: str, layers: Sequence[Module]) -> Projections:
    """``owner``'s `Projections` of ``layers``, kept under private attribute ``name``
    (not a parameter): made on first use, and again when the layers changed."""
    current: Projections | None = getattr(owner, name, None)
    if current is None or not current.fresh(layers):
        current = Projections(layers)
        setattr(owner, name, current)
    return current


__all__ = ["FusedLinears", "Projections", "fused"]
