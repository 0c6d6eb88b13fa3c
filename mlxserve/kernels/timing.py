"""Time the MoE variants at one expert shape, recording failures instead of dying.

A calibration (and the benchmarks) build one mlx-lm ``SwitchGLU`` with random packed
weights of the model's expert shape (no float copy is ever made), route tokens
uniformly, and run a forward per variant. A variant whose forward raises (say, a
kernel launch the device refuses) is recorded with its error and left out of the
timed rounds; the others go on. Rounds interleave the variants and medians are
kept, so load from other processes hits every variant alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from .switch import VARIANT_CLASSES
from .tiles import forget_tiles

Clock = Callable[[], float]

MX_MODES = ("mxfp4", "mxfp8")
"""Microscaling modes whose random scales are easy to draw (E8M0 exponents)."""


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of one MoE layer: ``gate``/``up`` are ``K -> N``, ``down`` ``N -> K``."""

    experts: int
    top_k: int
    in_dims: int
    out_dims: int
    bits: int
    group_size: int
    mode: str = "affine"

    def check(self) -> None:
        """ValueError when random weights of this shape cannot be built."""
        if self.mode != "affine" and self.mode not in MX_MODES:
            raise ValueError(f"cannot build random {self.mode} experts (affine, mxfp4, mxfp8)")
        for dims in (self.in_dims, self.out_dims):
            if dims % self.group_size or dims * self.bits % 32:
                raise ValueError(f"dimension {dims} does not pack into {self.bits}-bit groups")


@dataclass(frozen=True)
class Timed:
    """One variant at one shape: median seconds, or the error its forward raised."""

    variant: str
    seconds: float | None
    max_abs_diff: float | None
    error: str | None


def _random_layer(
    experts: int, n: int, k: int, shape: ExpertShape, dtype: mx.Dtype, key: mx.array
) -> QuantizedSwitchLinear:
    """A stock ``QuantizedSwitchLinear`` holding random packed weights ``[experts, n, k]``.

    Built tiny and then given its arrays: its constructor draws float weights of the
    full shape first (8 GB for 256 DeepSeek-V4-Flash experts).
    """
    gs = shape.group_size
    layer = QuantizedSwitchLinear(
        gs, 1, 1, bias=False, group_size=gs, bits=shape.bits, mode=shape.mode
    )
    wkey, skey = mx.random.split(key)
    words = k * shape.bits // 32
    groups = k // gs
    layer.weight = mx.random.randint(0, 2**31 - 1, (experts, n, words), key=wkey).astype(mx.uint32)
    if shape.mode == "affine":
        levels = 2**shape.bits - 1
        span = 2.0 / math.sqrt(k) / levels
        scales = mx.random.uniform(0.5, 1.5, (experts, n, groups), key=skey) * span
        layer.scales = scales.astype(dtype)
        layer.biases = (-scales * levels / 2).astype(dtype)
    else:
        # E8M0 exponents around 2^-6: values of a few hundredths, like trained experts.
        layer.scales = mx.random.randint(118, 124, (experts, n, groups), key=skey).astype(mx.uint8)
    return layer


def random_switch_glu(shape: ExpertShape, dtype: mx.Dtype, seed: int = 0) -> SwitchGLU:
    """mlx-lm's SwitchGLU with random quantized experts of ``shape``, evaluated."""
    shape.check()
    block = SwitchGLU(shape.group_size, 1, 1)
    keys = mx.random.split(mx.random.key(seed), 3)
    n, k = shape.out_dims, shape.in_dims
    block.gate_proj = _random_layer(shape.experts, n, k, shape, dtype, keys[0])
    block.up_proj = _random_layer(shape.experts, n, k, shape, dtype, keys[1])
    block.down_proj = _random_layer(shape.experts, k, n, shape, dtype, keys[2])
    mx.eval(block.parameters())
    return block


def random_routing(tokens: int, shape: ExpertShape, seed: int = 1) -> mx.array:
    """``[1, tokens, top_k]`` expert indices, each token's experts distinct, uniform."""
    logits = mx.random.normal((tokens, shape.experts), key=mx.random.key(seed))
    top = mx.argpartition(-logits, shape.top_k - 1, axis=-1)[:, : shape.top_k]
    return top.astype(mx.uint32).reshape(1, tokens, shape.top_k)


def set_variant(block: SwitchGLU, cls: type[QuantizedSwitchLinear]) -> None:
    for layer in (block.gate_proj, block.up_proj, block.down_proj):
        layer.__class__ = cls


def _max_abs(a: mx.array) -> float:
    return float(mx.max(mx.abs(a)).astype(mx.float32).item())  # type: ignore[arg-type]


def error_text(exc: BaseException) -> str:
    """The first line of an exception, with its type: what a record keeps."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def time_variants(
    block: SwitchGLU,
    x: mx.array,
    indices: mx.array,
    variants: dict[str, type[QuantizedSwitchLinear]],
    repeats: int,
    *,
    clock: Clock = time.perf_counter,
    step: Callable[[], None] = lambda: None,
) -> tuple[float | None, list[Timed]]:
    """(largest magnitude of the first variant's output, one `Timed` per variant).

    The first variant is the reference the others' outputs are compared with. A
    variant that raises (``Exception``, not Ctrl-C) is recorded and not run again;
    ``step`` is called after every forward, for a progress bar.
    """

    def run(cls: type[QuantizedSwitchLinear]) -> tuple[float, mx.array]:
        set_variant(block, cls)
        forget_tiles()
        began = clock()
        y = block(x, indices)
        mx.eval(y)
        return clock() - began, y

    reference: mx.array | None = None
    errors: dict[str, str] = {}
    diffs: dict[str, float | None] = {}
    for name, cls in variants.items():  # warm-up, and check against the reference
        try:
            _, y = run(cls)
            if reference is None and not errors:
                reference = y
            diffs[name] = None if reference is None else _max_abs(y - reference)
        except Exception as exc:  # any failure of a variant is a result
            errors[name] = error_text(exc)
        step()
    times: dict[str, list[float]] = {name: [] for name in variants if name not in errors}
    for _ in range(repeats):
        for name, cls in variants.items():
            if name not in errors:
                try:
                    seconds, _ = run(cls)
                    times[name].append(seconds)
                except Exception as exc:
                    errors[name] = error_text(exc)
            step()
    scale = None if reference is None else _max_abs(reference)
    results = [
        Timed(
            variant=name,
            seconds=None if name in errors or not times[name] else statistics.median(times[name]),
            max_abs_diff=None if name in errors else diffs.get(name),
            error=errors.get(name),
        )
        for name in variants
    ]
    return scale, results


def variant_classes() -> dict[str, type[QuantizedSwitchLinear]]:
    """The layer class of each distinct policy variant, the stock one (``skip``) first.

    ``off`` is the same stock class as ``skip``, so it is not timed twice.
    """
    return {"skip": VARIANT_CLASSES["skip"], "full": VARIANT_CLASSES["full"]}
