"""Fault injection: the environment registry, the override, and each fault in-process."""

import threading

import pytest

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.request import FinishEvent, GenerationRequest, TokensEvent
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.reliability.faults import (
    CRASH_EXIT_CODE,
    FaultInjector,
    Faults,
    InjectedFault,
    active_faults,
    override_faults,
)
from tests.engine.conftest import tiny_llama


def step(index: int) -> Step:
    return Step(index=index, kind="decode", request_ids=("r",), num_tokens=1)


def test_nothing_armed_without_variables() -> None:
    faults = active_faults({"MLXSERVE_MODEL": "demo"})
    assert faults == Faults() and not faults.armed


def test_variables_arm_faults() -> None:
    faults = active_faults(
        {"MLXSERVE_FAULT_HANG_AT_STEP": "3", "MLXSERVE_FAULT_RAISE_AT_STEP": " 5 "}
    )
    assert faults == Faults(hang_at_step=3, raise_at_step=5)
    assert faults.describe() == "MLXSERVE_FAULT_HANG_AT_STEP=3, MLXSERVE_FAULT_RAISE_AT_STEP=5"


def test_the_follower_hang_is_not_rank_0s() -> None:
    faults = active_faults({"MLXSERVE_FAULT_FOLLOWER_HANG_AT_STEP": "1"})
    assert faults == Faults(follower_hang_at_step=1) and faults.armed
    FaultInjector(faults, hang_poll_s=0.01)(step(1))  # rank 0's engine: no hang
    # A follower arms it as its own hang (`run_follower`); see test_rank_watchdog.


@pytest.mark.parametrize("value", ["soon", "0", "-2", "1.5"])
def test_bad_values_name_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="MLXSERVE_FAULT_CRASH_AT_STEP must be a step index"):
        active_faults({"MLXSERVE_FAULT_CRASH_AT_STEP": value})


def test_override_wins_over_the_environment_and_is_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLXSERVE_FAULT_HANG_AT_STEP", "2")
    with override_faults(raise_at_step=4) as armed:
        assert active_faults() == armed == Faults(raise_at_step=4)
        with override_faults():
            assert not active_faults().armed
        assert active_faults() == armed
    assert active_faults() == Faults(hang_at_step=2)


def test_raise_fires_at_its_step_only() -> None:
    inject = FaultInjector(Faults(raise_at_step=2))
    inject(step(1))
    with pytest.raises(InjectedFault, match="step 2"):
        inject(step(2))
    inject(step(3))


def test_crash_exits_at_its_step() -> None:
    codes: list[int] = []
    inject = FaultInjector(Faults(crash_at_step=3), exit=codes.append)
    inject(step(2))
    assert codes == []
    inject(step(3))
    assert codes == [CRASH_EXIT_CODE]


def test_hang_blocks_until_released() -> None:
    inject = FaultInjector(Faults(hang_at_step=1), hang_poll_s=0.01)
    worker = threading.Thread(target=inject, args=(step(1),))
    worker.start()
    worker.join(0.3)
    assert worker.is_alive()
    inject.release.set()
    worker.join(5)
    assert not worker.is_alive()


def drain(engine: Engine, request: GenerationRequest) -> tuple[list[int], FinishEvent]:
    stream = engine.submit(request)
    for _ in range(1000):
        if not engine.run_once():
            break
    tokens: list[int] = []
    for _ in range(request.params.max_tokens + 1):
        event = stream.get(timeout=5)
        if isinstance(event, TokensEvent):
            tokens.extend(event.token_ids)
        else:
            assert isinstance(event, FinishEvent)
            return tokens, event
    raise AssertionError("no finish")


def test_raised_fault_fails_its_request_and_the_engine_keeps_serving() -> None:
    model = tiny_llama()
    prompt = tuple(range(3, 20))
    reference, _ = drain(
        Engine(PlainAdapter(model), EngineConfig()),
        GenerationRequest("r", GenerationParams(prompt, 6)),
    )
    with override_faults(raise_at_step=2):
        hook = FaultInjector(active_faults())
    engine = Engine(PlainAdapter(model), EngineConfig(prefix_cache_entries=0), before_step=hook)
    tokens, finish = drain(engine, GenerationRequest("a", GenerationParams(prompt, 6)))
    assert finish.finish_reason == "error"
    assert finish.error is not None and "InjectedFault" in finish.error
    tokens, finish = drain(engine, GenerationRequest("b", GenerationParams(prompt, 6)))
    assert (tokens, finish.finish_reason) == (reference, "length")
