"""`benchmarks/step_modes.py` on the engine tests' tiny llama: each mode runs and reports its
parts (the timings themselves are the benchmark's to report, never asserted)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from tests.engine.conftest import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_every_mode_reports_its_step_and_parts() -> None:
    step_modes: Any = importlib.import_module("step_modes")
    model = tiny_llama()
    caches = step_modes.prefilled(model, 2, 5)
    assert len(caches) == 2 and all(layer.offset == 5 for layer in caches[0])
    result = step_modes.decode_modes(model, 1, 5, 3)
    assert set(result) == {"synced", "pipelined", "built_ahead"}
    for parts in result.values():
        assert set(parts) == {"step_ms", "build_ms", "queue_ms", "wait_ms"}
        assert parts["step_ms"] > 0 and parts["build_ms"] > 0
