"""`benchmarks/step_modes.py` on a tiny generic model: each mode runs and reports its
parts (the timings themselves are the benchmark's to report, never asserted)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-6,
    "vocab_size": 64,
}


def test_every_mode_reports_its_step_and_parts() -> None:
    step_modes: Any = importlib.import_module("step_modes")
    serve: Any = importlib.import_module("serve")
    model = serve.random_model(TINY)
    mx.eval(model.parameters())
    caches = step_modes.prefilled(model, 2, 5)
    assert len(caches) == 2 and all(layer.offset == 5 for layer in caches[0])
    result = step_modes.decode_modes(model, 1, 5, 3)
    assert set(result) == {"synced", "pipelined", "built_ahead"}
    for parts in result.values():
        assert set(parts) == {"step_ms", "build_ms", "queue_ms", "wait_ms"}
        assert parts["step_ms"] > 0 and parts["build_ms"] > 0
