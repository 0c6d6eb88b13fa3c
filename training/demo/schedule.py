"""Small pieces every training phase shares: the learning-rate schedule and freezing."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 5% of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def scalar(value: mx.array) -> float:
    return float(np.asarray(value))


def freeze_non_trainable(model: Module) -> None:
    """Hash tables are integer lookups; routing biases are set by balancing, not SGD."""
    modules: list[tuple[str, Module]] = model.named_modules()  # type: ignore[no-untyped-call]
    for _, module in modules:
        if hasattr(module, "tid2eid"):
            module.freeze(keys=["tid2eid"], recurse=False)
        if hasattr(module, "bias") and hasattr(module, "top_k"):
            module.freeze(keys=["bias"], recurse=False)


def train_only_mtp(model: Module) -> None:
    """Freeze everything but the MTP blocks (and keep the fixed tables frozen)."""
    model.freeze()
    for block in model.mtp:
        block.unfreeze()
    freeze_non_trainable(model)


def train_all(model: Module) -> None:
    model.unfreeze()
    freeze_non_trainable(model)
