"""The progress watchdog, driven by hand with a fake clock and an exit that records."""

import logging
import threading
import time

import pytest

from mlxserve.engine.core.step import Step
from mlxserve.reliability.watchdog import STALL_EXIT_CODE, Watchdog, format_thread_stacks

STEP = Step(index=7, kind="decode", request_ids=("req-a", "req-b"), num_tokens=1)


class FakeEngine:
    def __init__(self) -> None:
        self.progress = 0
        self.current_step: Step | None = None
        self.warming_up = False


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def exits() -> list[int]:
    return []


@pytest.fixture
def watchdog(engine: FakeEngine, clock: FakeClock, exits: list[int]) -> Watchdog:
    return Watchdog(engine, 10.0, clock=clock, exit=exits.append, stacks=lambda: "<stacks>")


def test_idle_engine_never_fires(watchdog: Watchdog, clock: FakeClock, exits: list[int]) -> None:
    for _ in range(100):
        clock.now += 60
        assert watchdog.check() == "idle"
    assert exits == []


def test_stuck_step_warns_once_then_exits_75_with_diagnostic(
    watchdog: Watchdog,
    engine: FakeEngine,
    clock: FakeClock,
    exits: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine.current_step = STEP
    assert watchdog.check() == "progressing"  # first seen in flight: the stall clock starts
    clock.now += 4.9
    assert watchdog.check() == "progressing"
    clock.now += 0.1
    with caplog.at_level(logging.WARNING, logger="mlxserve.reliability.watchdog"):
        assert watchdog.check() == "slow"
        clock.now += 2
        assert watchdog.check() == "slow"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "step 7 (decode, requests req-a, req-b)" in warnings[0].getMessage()
        assert exits == []
        clock.now += 3
        assert watchdog.check() == "stalled"
        assert exits == [STALL_EXIT_CODE]
        clock.now += 30
        assert watchdog.check() == "stalled"
        assert exits == [STALL_EXIT_CODE]  # fires once
    [report] = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert "no progress for 10.0 s" in report
    assert "index=7 kind=decode num_tokens=1" in report
    assert "requests: req-a, req-b" in report
    assert "<stacks>" in report


def test_progress_restarts_the_stall_clock(
    watchdog: Watchdog, engine: FakeEngine, clock: FakeClock, exits: list[int]
) -> None:
    engine.current_step = STEP
    for _ in range(50):
        clock.now += 6
        engine.progress += 1
        assert watchdog.check() == "progressing"
        clock.now += 3
        assert watchdog.check() == "progressing"
    assert exits == []


def test_idle_time_does_not_count_against_the_next_step(
    watchdog: Watchdog, engine: FakeEngine, clock: FakeClock, exits: list[int]
) -> None:
    clock.now += 3600
    assert watchdog.check() == "idle"
    clock.now += 1
    engine.current_step = STEP  # started at some point in the last second
    assert watchdog.check() == "progressing"
    clock.now += 9.9
    assert watchdog.check() == "slow"
    clock.now += 0.1
    assert watchdog.check() == "stalled"
    assert exits == [STALL_EXIT_CODE]


def test_each_stuck_step_gets_its_own_warning(
    watchdog: Watchdog,
    engine: FakeEngine,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine.current_step = STEP
    with caplog.at_level(logging.WARNING, logger="mlxserve.reliability.watchdog"):
        watchdog.check()
        clock.now += 6
        assert watchdog.check() == "slow"
        engine.progress += 1
        engine.current_step = Step(8, "prefill", ("req-c",), 512)
        assert watchdog.check() == "progressing"
        clock.now += 6
        assert watchdog.check() == "slow"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "step 8 (prefill, requests req-c)" in messages[1]


def test_a_warm_up_step_gets_the_allowance_and_no_more(
    engine: FakeEngine,
    clock: FakeClock,
    exits: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A compiling warm-up step may outlast the timeout, up to the allowance; serving's
    steps keep the timeout."""
    watchdog = Watchdog(
        engine, 10.0, warm_up_timeout_s=100.0, clock=clock, exit=exits.append, stacks=lambda: ""
    )
    engine.warming_up = True
    engine.current_step = STEP
    assert watchdog.check() == "progressing"
    clock.now += 49
    assert watchdog.check() == "progressing"  # past the timeout, under the allowance's half
    clock.now += 1
    assert watchdog.check() == "slow"
    engine.progress += 1  # the warm-up's step finished; a serving step follows
    engine.warming_up = False
    assert watchdog.check() == "progressing"
    clock.now += 10
    assert watchdog.check() == "stalled" and exits == [STALL_EXIT_CODE]

    stalled = Watchdog(
        engine, 10.0, warm_up_timeout_s=100.0, clock=clock, exit=exits.append, stacks=lambda: ""
    )
    engine.warming_up = True
    with caplog.at_level(logging.CRITICAL, logger="mlxserve.reliability.watchdog"):
        assert stalled.check() == "progressing"
        clock.now += 99.9
        assert stalled.check() == "slow" and len(exits) == 1
        clock.now += 0.1
        assert stalled.check() == "stalled" and len(exits) == 2  # bounded
    reports = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert "(progress_timeout_s=10)" in reports[0]
    assert "(progress_timeout_s=10, warming up: 100 s allowed)" in reports[1]


def test_bad_settings_are_rejected(engine: FakeEngine) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(engine, 0)
    with pytest.raises(ValueError, match="soft_fraction"):
        Watchdog(engine, 1, soft_fraction=1.0)
    with pytest.raises(ValueError, match="warm_up_timeout_s"):
        Watchdog(engine, 1, warm_up_timeout_s=-1)


def test_thread_fires_on_a_real_clock(engine: FakeEngine) -> None:
    fired = threading.Event()
    codes: list[int] = []

    def record(code: int) -> None:
        codes.append(code)
        fired.set()

    watchdog = Watchdog(engine, 0.3, exit=record, stacks=lambda: "")
    engine.current_step = STEP
    started = time.monotonic()
    watchdog.start()
    try:
        assert fired.wait(5)
        assert 0.3 <= time.monotonic() - started < 2
        assert codes == [STALL_EXIT_CODE]
    finally:
        watchdog.stop()


def test_thread_stays_quiet_while_steps_finish(engine: FakeEngine) -> None:
    codes: list[int] = []
    watchdog = Watchdog(engine, 0.3, exit=codes.append, stacks=lambda: "")
    engine.current_step = STEP
    watchdog.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            engine.progress += 1
            time.sleep(0.02)
    finally:
        watchdog.stop()
    assert codes == []


def test_thread_stacks_name_every_thread() -> None:
    release = threading.Event()

    def parked_in_a_named_function() -> None:
        release.wait(10)

    thread = threading.Thread(target=parked_in_a_named_function, name="parked-thread")
    thread.start()
    try:
        stacks = format_thread_stacks()
    finally:
        release.set()
        thread.join(10)
    assert "thread parked-thread" in stacks
    assert "parked_in_a_named_function" in stacks
    assert "thread MainThread" in stacks
