"""What a step like the one in flight usually takes: p99 per kind, prefill per token."""

from mlxserve.engine.step_plan import StepPlan
from mlxserve.engine.step_times import StepTimes


def plan(kind: str, tokens: int = 1) -> StepPlan:
    return StepPlan(1, kind, ("r",), tokens)  # type: ignore[arg-type]


def test_p99_per_kind_and_prefill_scales_with_its_tokens() -> None:
    times = StepTimes(window=100)
    assert times.expected_s(plan("decode")) == 0.0  # nothing measured yet
    for i in range(100):
        times.record(plan("decode"), 0.01 if i < 98 else 0.5)
    times.record(plan("prefill", 10), 0.1)  # 10 ms per prompt token
    assert times.p99("decode") == 0.5
    assert times.expected_s(plan("decode")) == 0.5
    assert abs(times.expected_s(plan("prefill", 512)) - 5.12) < 1e-9
    assert times.expected_s(plan("speculate")) == 0.0
    assert times.expected_s(None) == 0.5  # idle: the decode-like steps


def test_the_window_forgets_old_steps() -> None:
    times = StepTimes(window=4)
    times.record(plan("decode"), 9.0)
    for _ in range(4):
        times.record(plan("decode"), 0.02)
    assert times.p99("decode") == 0.02


def test_where_kernels_compile_every_step_gets_the_floor() -> None:
    """On a device that compiles on first use (any new shape, in or between steps)
    the expected time never drops below the step floor; a warm-up's clear forgets
    its durations."""
    times = StepTimes(floor_s=1.25)
    assert times.expected_s(plan("decode")) == 1.25
    assert times.expected_s(None) == 1.25
    times.record(plan("decode"), 0.01)
    assert times.expected_s(plan("decode")) == 1.25
    times.record(plan("decode"), 2.0)
    assert times.expected_s(plan("decode")) == 2.0
    times.clear()
    assert times.p99("decode") is None
    assert StepTimes().expected_s(plan("decode")) == 0.0  # nothing compiles: no floor


def test_step_floor_by_device() -> None:
    from mlxserve.hardware.probe import step_floor_s

    assert step_floor_s("cuda") > 0
    assert step_floor_s("cpu") == step_floor_s("metal") == 0.0
