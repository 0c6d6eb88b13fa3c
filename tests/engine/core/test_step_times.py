"""What a step like the one in flight usually takes: p99 per kind, prefill per token."""

import time
from types import SimpleNamespace
from typing import Any

import pytest

from mlxserve.engine.core.step import Step
from mlxserve.engine.core.step_times import StepTimes


def step(kind: str, tokens: int = 1) -> Step:
    return Step(1, kind, ("r",), tokens)  # type: ignore[arg-type]


def test_p99_per_kind_and_prefill_scales_with_its_tokens() -> None:
    times = StepTimes(window=100)
    assert times.expected_s(step("decode")) == 0.0  # nothing measured yet
    for i in range(100):
        times.record(step("decode"), 0.01 if i < 98 else 0.5)
    times.record(step("prefill", 10), 0.1)  # 10 ms per prompt token
    assert times.p99("decode") == 0.5
    assert times.expected_s(step("decode")) == 0.5
    assert abs(times.expected_s(step("prefill", 512)) - 5.12) < 1e-9
    assert times.expected_s(step("speculate")) == 0.0
    assert times.expected_s(None) == 0.5  # idle: the decode-like steps


def test_the_window_forgets_old_steps() -> None:
    times = StepTimes(window=4)
    times.record(step("decode"), 9.0)
    for _ in range(4):
        times.record(step("decode"), 0.02)
    assert times.p99("decode") == 0.02


def test_where_kernels_compile_every_step_gets_the_floor() -> None:
    """On a device that compiles on first use (any new shape, in or between steps)
    the expected time never drops below the step floor; a warm-up's clear forgets
    its durations."""
    times = StepTimes(floor_s=1.25)
    assert times.expected_s(step("decode")) == 1.25
    assert times.expected_s(None) == 1.25
    times.record(step("decode"), 0.01)
    assert times.expected_s(step("decode")) == 1.25
    times.record(step("decode"), 2.0)
    assert times.expected_s(step("decode")) == 2.0
    times.clear()
    assert times.p99("decode") is None
    assert StepTimes().expected_s(step("decode")) == 0.0  # nothing compiles: no floor


def test_step_floor_by_device() -> None:
    from mlxserve.hardware.probe import step_floor_s

    assert step_floor_s("cuda") > 0
    assert step_floor_s("cpu") == step_floor_s("metal") == 0.0


def _engine_whose_calibration_takes_100_s(monkeypatch: pytest.MonkeyPatch, fails: bool) -> Any:
    """The demo engine, automatic depth, its clock jumping 100 s while it calibrates
    (and the calibration raising, with `fails`); (engine, prompt, jumps)."""
    from mlxserve.engine.core import stepper
    from mlxserve.engine.core.build import adapter_for, materialize
    from mlxserve.engine.core.stepper import Engine, EngineConfig
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    adapter = adapter_for(model, "auto")
    skipped = [0.0]  # seconds the engine's clock jumped while calibrating
    measure = adapter.measure_costs

    def slow_measure(**kwargs: Any) -> Any:
        skipped[0] += 100.0
        if fails:
            raise RuntimeError("calibration failed")
        return measure(**kwargs)

    monkeypatch.setattr(adapter, "measure_costs", slow_measure)
    clock = SimpleNamespace(monotonic=lambda: time.monotonic() + skipped[0], sleep=time.sleep)
    monkeypatch.setattr(stepper, "time", clock)
    engine = Engine(adapter, EngineConfig(speculative_depth="auto"))
    return engine, tuple(tokenizer.encode("Python reference: for")), skipped


def test_the_depth_calibration_is_not_a_speculative_step_s_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The calibration runs once, inside the first speculative step, and counts as
    progress as it goes: its time (here made 100 s on the engine's clock) must not
    become what a speculative step usually takes. It did: the front's hang limit,
    20 x p99, was then about 20 s on a CPU instead of the 3 s floor, for the
    engine's first 100 speculative steps (a frozen engine kept its streams 20 s)."""
    from mlxserve.channel.request import GenerationParams
    from mlxserve.engine.core.request import GenerationRequest
    from tests.engine.drive import run

    engine, prompt, skipped = _engine_whose_calibration_takes_100_s(monkeypatch, fails=False)
    run(engine, GenerationRequest("a", GenerationParams(prompt, 24)))
    assert engine.depth_picker is not None and skipped == [100.0]  # calibrated, once
    p99 = engine.step_times.p99("speculate")
    assert p99 is not None and p99 < 50.0, p99
    assert engine.step_times.expected_s(None) < 50.0


def test_a_failed_calibration_is_not_a_speculative_step_s_time_either(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A calibration that raises fails its step's requests; its 100 s are not that
    step's time."""
    from mlxserve.channel.request import GenerationParams
    from mlxserve.engine.core.request import GenerationRequest
    from tests.engine.drive import run

    engine, prompt, skipped = _engine_whose_calibration_takes_100_s(monkeypatch, fails=True)
    run(engine, GenerationRequest("a", GenerationParams(prompt, 24)))
    assert engine.depth_picker is None and skipped == [100.0]
    p99 = engine.step_times.p99("speculate")
    assert p99 is not None and p99 < 50.0, p99
