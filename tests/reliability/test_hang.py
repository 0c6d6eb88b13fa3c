"""The hang detector: only an engine that owes work and stops is suspected, and only
an engine that then confirms it (or cannot answer) is declared hung."""

from mlxserve.reliability.hang import EngineStatus, HangDetector, LoopPauses


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def detector(floor_s: float = 3.0) -> tuple[HangDetector, LoopPauses, Clock]:
    clock = Clock()
    pauses = LoopPauses(clock=clock)
    return HangDetector(floor_s, pauses), pauses, clock


def run(pauses: LoopPauses, clock: Clock, seconds: float) -> None:
    end = clock.now + seconds
    while clock.now < end - 1e-9:
        clock.now = min(end, clock.now + 0.1)
        pauses.look()


def test_an_engine_that_owes_nothing_is_never_suspected() -> None:
    hang, pauses, clock = detector()
    run(pauses, clock, 60)
    assert not hang.suspect(pauses.look())


def test_a_request_owed_with_the_counter_standing_still_is_suspected_then_verified() -> None:
    hang, pauses, clock = detector()
    hang.progress(10, 0.01, "decode", clock.now)
    hang.sent("r1", clock.now)
    run(pauses, clock, 2.9)
    assert not hang.suspect(pauses.look())
    run(pauses, clock, 0.2)
    now = pauses.look()
    assert hang.suspect(now)
    # A wedged step: the engine answers, has work, and its counter has not moved.
    evidence = hang.verdict(EngineStatus(running=1, queued=0, progress=10), now)
    assert evidence is not None
    assert evidence.owed_requests == 1 and evidence.steps == 10
    assert evidence.step_kind == "decode" and evidence.front_paused_s == 0
    assert evidence.stalled_for_s > 3.0
    assert "running=1" in evidence.summary()


def test_a_frozen_engine_that_cannot_answer_is_verified() -> None:
    hang, pauses, clock = detector()
    hang.sent("r1", clock.now)
    run(pauses, clock, 3.5)
    now = pauses.look()
    evidence = hang.verdict(None, now)
    assert evidence is not None and evidence.engine_status is None
    assert "no answer" in evidence.summary()
    assert evidence.heartbeat_age_s > 3.4


def test_a_finished_request_whose_client_does_not_read_is_not_owed() -> None:
    """The issue's first probe: the engine finished, the handler waits on the client."""
    hang, pauses, clock = detector()
    hang.sent("r1", clock.now)
    hang.progress(5, 0.01, "decode", clock.now)
    hang.done("r1")  # the engine's finish arrived; the stream stays open on the front
    run(pauses, clock, 60)
    assert not hang.suspect(pauses.look())


def test_a_pause_of_the_front_blames_nobody() -> None:
    hang, pauses, clock = detector()
    hang.sent("r1", clock.now)
    run(pauses, clock, 1.0)
    clock.now += 5.0  # SIGSTOP of the front: nothing on its loop ran
    now = pauses.look()
    assert pauses.count == 1
    assert not hang.suspect(now)
    assert 0.9 < hang.stalled_for(now) < 1.2
    run(pauses, clock, 2.5)  # the engine still stands still after the front is back
    now = pauses.look()
    assert hang.suspect(now)
    evidence = hang.verdict(None, now)
    assert evidence is not None and evidence.front_paused_s >= 5.0


def test_an_answer_that_shows_progress_or_no_work_clears_the_suspicion() -> None:
    hang, pauses, clock = detector()
    hang.progress(7, 0.0, None, clock.now)
    hang.sent("r1", clock.now)
    run(pauses, clock, 3.5)
    now = pauses.look()
    assert hang.verdict(EngineStatus(running=1, queued=0, progress=9), now) is None
    assert hang.steps == 9 and not hang.suspect(now)
    run(pauses, clock, 3.5)
    now = pauses.look()
    assert hang.verdict(EngineStatus(running=0, queued=0, progress=9), now) is None
    assert not hang.suspect(now)


def test_a_restart_resets_the_clock() -> None:
    """The restarted engine was declared hung within 0.1 s: its timer was the old one's."""
    hang, pauses, clock = detector()
    hang.sent("r1", clock.now)
    run(pauses, clock, 10)
    assert hang.suspect(pauses.look())
    hang.reset(pauses.look())
    assert not hang.owed
    hang.sent("r2", clock.now)
    run(pauses, clock, 1)
    assert not hang.suspect(pauses.look())


def test_the_limit_follows_the_engine_step_times() -> None:
    hang, pauses, clock = detector(floor_s=1.0)
    hang.progress(1, 0.5, "prefill", clock.now)  # a slow kind of step: 20 x 0.5 s
    hang.sent("r1", clock.now)
    assert hang.limit_s() == 10.0
    run(pauses, clock, 9)
    assert not hang.suspect(pauses.look())


def test_pauses_are_counted_only_inside_the_window() -> None:
    clock = Clock()
    pauses = LoopPauses(clock=clock)
    clock.now += 4
    pauses.look()
    assert pauses.paused_within(0, clock.now) == 4
    assert pauses.paused_within(clock.now - 1, clock.now) == 1
    assert pauses.paused_within(clock.now, clock.now + 10) == 0
    assert pauses.last_pause_end() == clock.now
