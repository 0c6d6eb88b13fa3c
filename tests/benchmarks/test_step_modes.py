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


def test_the_build_profile_names_the_model_functions_it_ran() -> None:
    step_modes: Any = importlib.import_module("step_modes")
    model = tiny_llama()
    profile = step_modes.profile_build(model, 1, 4, steps=2, top=50)
    assert profile["steps"] == 2 and profile["profiled_ms_per_step"] > 0
    inside = {row["function"]: row for row in profile["by_time_inside"]}
    # mlx-lm's llama forward is called once a step, its attention once a layer a step
    forward = next(row for name, row in inside.items() if "models/llama.py" in name)
    assert forward["calls_per_step"] >= 1
    assert all(row["ms_per_step"] >= 0 for row in profile["by_own_time"])


def test_the_fast_paths_a_step_took_are_reported() -> None:
    """A DeepSeek-V4 with quantised experts decodes each MoE block as one compiled
    function, unless told not to; a CPU step has no custom-kernel node."""
    from mlx.nn.layers.quantized import quantize
    from mlx_lm.models.switch_layers import SwitchLinear

    from tests.engine.v4_models import tiny_v4

    step_modes: Any = importlib.import_module("step_modes")
    model = tiny_v4(seed=3, hidden_size=64, moe_intermediate_size=32, hc_mult=4)
    quantize(model, 32, 4, class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    found = step_modes.fast_paths(model, 1, 6)
    assert found == {"custom_kernel_nodes": 0, "moe_blocks_compiled": len(model.layers)}
    for layer in model.layers:
        layer.ffn.compile_decode = False
        layer.ffn._decode_plan = None
    assert step_modes.fast_paths(model, 1, 6)["moe_blocks_compiled"] == 0
