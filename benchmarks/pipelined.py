"""Decode steps timed as mlx-lm and the engine run them; used by several benchmarks.

The engine (and mlx-lm's generate loop) queues step n + 1, built from step n's lazy
output, before it reads step n's output back, so the host builds a step while the
device runs the one before. A step timed alone (built, run, waited for) adds the
two; this loop is what a client sees per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx


def pipelined_steps(
    step: Callable[[mx.array], mx.array], first: mx.array, steps: int
) -> tuple[float, list[Any]]:
    """Seconds per step of ``steps`` steps, each ``step(previous output)`` queued
    (``mx.async_eval``) before the previous output is read (``tolist``), and every
    output read: ``first``, the ``steps`` timed ones, and the one queued last (read
    after the clock stopped, so no step is left pending). The clock starts with the
    pipeline filled: ``first`` read and the step after it queued."""
    if steps < 1:
        raise ValueError(f"pipelined_steps times at least one step, not {steps}")
    mx.async_eval(first)  # type: ignore[no-untyped-call]
    current = step(first)
    mx.async_eval(current)  # type: ignore[no-untyped-call]
    read = [first.tolist()]
    began = time.perf_counter()
    for _ in range(steps):
        following = step(current)
        mx.async_eval(following)  # type: ignore[no-untyped-call]
        read.append(current.tolist())
        current = following
    seconds = (time.perf_counter() - began) / steps
    read.append(current.tolist())
    return seconds, read
