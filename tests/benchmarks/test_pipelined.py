"""`benchmarks/pipelined.py`: the queued-ahead loop reads the outputs a synced chain gives."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_every_output_is_read_in_order_and_none_left_pending() -> None:
    pipelined: Any = importlib.import_module("pipelined")
    calls: list[int] = []

    def step(previous: mx.array) -> mx.array:
        calls.append(1)
        return (previous * 3 + 1) % 101

    seconds, read = pipelined.pipelined_steps(step, mx.array([2, 5]), 4)
    expected = [[2, 5]]
    for _ in range(5):
        expected.append([(v * 3 + 1) % 101 for v in expected[-1]])
    assert read == expected  # first, the 4 timed steps and the last one queued
    assert len(calls) == 5 and seconds > 0
    with pytest.raises(ValueError, match="at least one step"):
        pipelined.pipelined_steps(step, mx.array([1]), 0)
