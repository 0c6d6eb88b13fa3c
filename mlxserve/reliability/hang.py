"""Telling an engine hang from everything that only looks like one.

A hang is an engine that has work it can do and makes no progress. The front
sees three things that look the same from outside and are not:

- a client that does not read its stream: the engine finished long ago and the
  handler waits on the client's socket. The request is no longer the engine's
  work, so it never counts (`HangDetector.owed` holds only requests the engine
  has not finished);
- the front itself not running (SIGSTOP, a swap or GC stall, a heavy call on the
  event loop): every clock on the loop jumps, and the engine's reports sit unread
  in the socket. `LoopPauses` notices the jump, and the stall clock restarts, so a
  front that did not run blames nobody;
- a long but legitimate step: the limit scales with the engine's own recent
  step times (`limit_s`).

What is left is a suspicion, not yet a hang. The engine is asked for its status
over the same socket: an answer with the counter moved, or with nothing to do,
clears it; an answer with work and the same counter (a wedged step), or no
answer at all (a frozen process), verifies it. Only a verified hang is
declared, and it carries its evidence to the incident memory that the kernel
policy reads (`Evidence`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

#: A gap between two looks at the loop this long means the loop did not run.
PAUSE_S = 1.0
#: A step this many times its kind's p99 is not slow but hung.
P99_MULTIPLE = 20.0
PAUSES_KEPT = 64


class LoopPauses:
    """When this process's event loop did not run, from the gaps between looks at it.

    Why: every timeout the front judges an engine by is measured on the front's
    clock, and a front that was stopped for 5 s sees 5 s of silence from every
    engine although none was silent. Anything that ticks on the loop calls
    `look()`; a gap over `pause_s` is recorded as a pause. `run()` keeps looking
    every `tick_s` so a pause is seen even when nothing else ticks.
    """

    def __init__(
        self,
        *,
        tick_s: float = 0.1,
        pause_s: float = PAUSE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tick_s = tick_s
        self.pause_s = pause_s
        self._clock = clock
        self._last = clock()
        self._pauses: deque[tuple[float, float]] = deque(maxlen=PAUSES_KEPT)
        self.total_s = 0.0
        self.count = 0

    def look(self) -> float:
        """Now, after recording the gap since the last look if the loop did not run."""
        now = self._clock()
        gap = now - self._last
        if gap > self.pause_s:
            self._pauses.append((self._last, now))
            self.total_s += gap
            self.count += 1
        self._last = now
        return now

    def last_pause_end(self) -> float:
        """When the newest pause ended (0 when there was none)."""
        return self._pauses[-1][1] if self._pauses else 0.0

    def paused_within(self, start: float, end: float) -> float:
        """Seconds of [start, end] the loop spent paused."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self._pauses)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.look()


@dataclass(frozen=True)
class EngineStatus:
    """The engine's own answer to 'what are you doing?'."""

    running: int
    queued: int
    progress: int


@dataclass(frozen=True)
class Evidence:
    """Why a hang was declared: what the engine and the front each showed."""

    stalled_for_s: float
    limit_s: float
    steps: int
    step_kind: str | None
    expected_step_s: float
    owed_requests: int
    #: Seconds since the engine last sent anything (its reports come a few times a second).
    heartbeat_age_s: float
    #: Seconds the front's own loop was paused since it last saw a step (not counted).
    front_paused_s: float
    #: The engine's answer to the status asked before declaring; None: it did not answer.
    engine_status: EngineStatus | None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key, value in data.items():
            if isinstance(value, float):
                data[key] = round(value, 3)
        return data

    def summary(self) -> str:
        answer = (
            "no answer to a status request"
            if self.engine_status is None
            else f"it answered running={self.engine_status.running} "
            f"queued={self.engine_status.queued} steps={self.engine_status.progress}"
        )
        return (
            f"no step finished for {self.stalled_for_s:.1f} s (limit {self.limit_s:.1f} s) "
            f"with {self.owed_requests} request(s) owed; {answer}; "
            f"last heard {self.heartbeat_age_s:.1f} s ago"
        )


class HangDetector:
    """One engine's hang clock, driven by what its channel delivers; see the module docstring.

    Pure logic with the clock passed in, so tests can drive every case by hand.
    """

    def __init__(self, floor_s: float, pauses: LoopPauses) -> None:
        self.floor_s = floor_s
        self.pauses = pauses
        self.owed: set[str] = set()
        self.reset(pauses.look())

    def reset(self, now: float) -> None:
        """A new engine (a start or a restart): nothing owed, the clock from now."""
        self.owed.clear()
        self.steps = -1
        self.step_kind: str | None = None
        self.expected_step_s = 0.0
        self.moved_at = now
        self.heard_at = now
        self.work_since = now
        self.cleared_at = now

    # -- what the channel delivers ---------------------------------------------------

    def sent(self, request_id: str, now: float) -> None:
        """A request went to the engine: it owes a finish."""
        if not self.owed:
            self.work_since = now
        self.owed.add(request_id)

    def done(self, request_id: str) -> None:
        """The engine finished the request (or the front stopped waiting for it)."""
        self.owed.discard(request_id)

    def heard(self, now: float) -> None:
        self.heard_at = now

    def progress(self, steps: int, expected_step_s: float, kind: str | None, now: float) -> None:
        self.heard_at = now
        if steps != self.steps:
            self.steps = steps
            self.moved_at = now
        self.expected_step_s = expected_step_s
        if kind is not None:
            self.step_kind = kind

    # -- judging ---------------------------------------------------------------------

    def limit_s(self) -> float:
        """How long the step counter may stand still while the engine owes requests."""
        return max(self.floor_s, P99_MULTIPLE * self.expected_step_s)

    def stalled_for(self, now: float) -> float:
        """Seconds the engine owed requests, the front ran, and no step finished."""
        if not self.owed:
            return 0.0
        since = max(self.moved_at, self.work_since, self.cleared_at)
        return max(0.0, now - since - self.pauses.paused_within(since, now))

    def suspect(self, now: float) -> bool:
        """Whether the stall is long enough to ask the engine (call after `pauses.look()`)."""
        return self.stalled_for(now) > self.limit_s()

    def verdict(self, status: EngineStatus | None, now: float) -> Evidence | None:
        """The evidence of a verified hang, or None (and the clock restarts) if the
        engine's answer clears it: its counter moved, or it has nothing to do."""
        if status is not None and status.progress != self.steps:
            self.progress(status.progress, self.expected_step_s, None, now)  # it moved
            return None
        if status is not None and status.running + status.queued == 0:
            self.cleared_at = now  # nothing to do: the front's view of what it owes is stale
            return None
        since = max(self.moved_at, self.work_since, self.cleared_at)
        return Evidence(
            stalled_for_s=self.stalled_for(now),
            limit_s=self.limit_s(),
            steps=self.steps,
            step_kind=self.step_kind,
            expected_step_s=self.expected_step_s,
            owed_requests=len(self.owed),
            heartbeat_age_s=now - self.heard_at,
            front_paused_s=self.pauses.paused_within(since, now),
            engine_status=status,
        )
