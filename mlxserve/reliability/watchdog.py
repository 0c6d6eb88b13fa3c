"""The progress watchdog: a step that makes no progress for too long ends the process.

An MLX call that never returns (a collective that lost a completion, a wedged
command buffer) cannot be interrupted or cancelled; only its process can be
ended. So the watchdog watches the engine's progress counter (steps finished),
not a heartbeat, which a separate thread would keep beating while the forward
is wedged. When a step is in flight and the counter has not moved for
`timeout_s`, it logs what was running and every thread's stack (named Python
frames, then faulthandler's dump, with native frames where Python has them), then
exits with code 75 (EX_TEMPFAIL: the front retries elsewhere and restarts
this engine). At `soft_fraction` of the timeout it only warns, once per step.

Time is counted from when the watchdog first saw the current step in flight
(or the last progress), never across idle periods: an engine that waited an
hour for work and then starts a step has a full timeout for that step.

While the engine warms up (`mlxserve.engine.process.warmup`: its steps compile kernels,
tens of seconds each on CUDA) a step may take up to `warm_up_timeout_s` instead,
when that is longer: a bounded allowance, so a group that wedges during the
warm-up still ends, and serving's steps keep the plan's timeout.
"""

import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

log = logging.getLogger(__name__)


class Step(Protocol):
    """What the watchdog and the faults read of the engine's step
    (`mlxserve.engine.core.step.Step`): the engine imports this package, so this
    package does not import the engine."""

    @property
    def index(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def request_ids(self) -> tuple[str, ...]: ...
    @property
    def num_tokens(self) -> int: ...


STALL_EXIT_CODE = 75

Verdict = Literal["idle", "progressing", "slow", "stalled"]


class Watched(Protocol):
    """What the watchdog reads from the engine (plain attributes, written by its thread)."""

    @property
    def progress(self) -> int: ...

    @property
    def current_step(self) -> Step | None: ...

    @property
    def warming_up(self) -> bool: ...


@dataclass(frozen=True)
class Stall:
    """A step in flight with no progress: what the diagnostic reports."""

    step: Step
    progress: int
    stalled_for_s: float
    timeout_s: float


class Watchdog:
    """Checks `target` every `poll_s` from its own daemon thread; see the module docstring.

    `clock`, `exit` and `stacks` are injectable for tests: `check()` can be
    driven by hand with a fake clock and an exit that records the code.
    """

    def __init__(
        self,
        target: Watched,
        timeout_s: float,
        *,
        soft_fraction: float = 0.5,
        warm_up_timeout_s: float = 0.0,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], object] = os._exit,
        stacks: Callable[[], str] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if not 0 < soft_fraction < 1:
            raise ValueError("soft_fraction must be in (0, 1)")
        if warm_up_timeout_s < 0:
            raise ValueError("warm_up_timeout_s must be >= 0")
        self.target = target
        self.timeout_s = timeout_s
        self.soft_fraction = soft_fraction
        self.warm_up_timeout_s = max(timeout_s, warm_up_timeout_s)
        # Detection lags by at most one poll; a tenth of the timeout, within [10 ms, 1 s].
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.01, timeout_s / 10))
        self._clock = clock
        self._exit = exit
        self._stacks = stacks or format_thread_stacks
        self._last_progress = target.progress
        self._since = clock()
        self._watching = False  # a step was in flight at the last check
        self._warned = False
        self._fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mlxserve-watchdog", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check() == "stalled":
                return

    def check(self) -> Verdict:
        """One look at the engine; warns or exits as due. Returns what it saw."""
        now = self._clock()
        progress = self.target.progress
        step = self.target.current_step
        if progress != self._last_progress or step is None or not self._watching:
            # A step finished, none is running, or one was just seen starting: the
            # stall clock restarts (so a stall is detected up to one poll late, never early).
            self._last_progress = progress
            self._since = now
            self._warned = False
            self._watching = step is not None
            return "idle" if step is None else "progressing"
        stalled_for = now - self._since
        timeout_s = self.limit_s()
        if stalled_for >= timeout_s:
            if not self._fired:
                self._fired = True
                self._fire(Stall(step, progress, stalled_for, timeout_s))
            return "stalled"
        if stalled_for >= timeout_s * self.soft_fraction:
            if not self._warned:
                self._warned = True
                log.warning(
                    "watchdog: step %d (%s, requests %s) has made no progress for %.1f s "
                    "(the engine exits at %.1f s)",
                    step.index,
                    step.kind,
                    ", ".join(step.request_ids),
                    stalled_for,
                    timeout_s,
                )
            return "slow"
        return "progressing"

    def limit_s(self) -> float:
        """The seconds the current step may go without progress: the warm-up's
        allowance while the engine warms up, else the timeout."""
        return self.warm_up_timeout_s if self.target.warming_up else self.timeout_s

    def _fire(self, stall: Stall) -> None:
        try:
            log.critical("%s", self.diagnostic(stall))
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            dump_native_stacks()
        finally:
            # Whatever happened while reporting, a stalled engine must go.
            self._exit(STALL_EXIT_CODE)

    def diagnostic(self, stall: Stall) -> str:
        step = stall.step
        lines = [
            f"watchdog: no progress for {stall.stalled_for_s:.1f} s "
            f"({self._limit(stall)}); exiting with code {STALL_EXIT_CODE}",
            f"  stuck step: index={step.index} kind={step.kind} num_tokens={step.num_tokens}",
            f"  requests: {', '.join(step.request_ids) or '(none)'}",
            f"  steps finished: {stall.progress}",
            "  thread stacks (most recent call last):",
            self._stacks(),
        ]
        return "\n".join(lines)

    def _limit(self, stall: Stall) -> str:
        limit = f"progress_timeout_s={self.timeout_s:g}"
        if stall.timeout_s != self.timeout_s:
            limit += f", warming up: {stall.timeout_s:g} s allowed"
        return limit


def dump_native_stacks() -> None:
    """faulthandler's dump of every thread, straight to stderr's file descriptor.

    Why besides `format_thread_stacks`: faulthandler writes without taking
    locks or allocating, so it works even when the wedged thread holds one, and
    where Python offers it (3.14+: `dump_c_stack`) it adds the native frames,
    which show the MLX call a collective is stuck in.
    """
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        dump_c_stack = getattr(faulthandler, "dump_c_stack", None)
        if dump_c_stack is not None:
            dump_c_stack(file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError, RuntimeError):  # no usable stderr: the exit matters more
        pass


def format_thread_stacks() -> str:
    """The Python stack of every thread, named, most recent call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocks = []
    for ident, frame in sys._current_frames().items():
        header = f"  --- thread {names.get(ident, '?')} (ident {ident}) ---"
        body = "".join(traceback.format_stack(frame)).rstrip()
        blocks.append(f"{header}\n{body}")
    return "\n".join(blocks)
