"""Fault injection, for tests only: make an engine process hang, crash or fail at a chosen step.

Failover is only as good as its tests, and the failures it handles (a wedged
collective, a dead rank, a failing kernel) cannot be produced on demand. These
switches produce their observable effects at a precise step instead. They are
read from the environment in exactly one place, `active_faults`, and armed
only by the engine process (`mlxserve.engine.process.loop`) and, for the one meant
for them, by a follower rank (`mlxserve.engine.process.follower`), each logging a warning
when any is set. Unset variables mean no fault; production never sets them.

"Step N" is the N-th step this process executes (`Step.index`,
counting from 1: the first prefill chunk of the first request is step 1).

Variables (each a positive integer step index):

- ``MLXSERVE_FAULT_HANG_AT_STEP=N``: step N blocks forever (sleeps in a loop)
  and never finishes, like an MLX collective that lost a completion. The
  progress watchdog ends the process with exit code 75.
- ``MLXSERVE_FAULT_CRASH_AT_STEP=N``: the process exits at once with code 3
  (`os._exit`, no cleanup), like a rank killed by the OS.
- ``MLXSERVE_FAULT_RAISE_AT_STEP=N``: step N raises `InjectedFault`; the engine
  fails that step's requests with finish_reason "error" and keeps serving.
- ``MLXSERVE_FAULT_FOLLOWER_HANG_AT_STEP=N``: on a follower rank only (rank 0's
  engine ignores it), step N blocks forever before its forward, while rank 0
  waits in that step's collective. Unlike a hang of rank 0, which leaves the
  followers blocked in a collective (that rank 0's exit may break first), this
  stall only the follower's own watchdog can end: exit 75, every time.

In-process tests use `override_faults(...)` instead of the environment.
"""

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields

from mlxserve.reliability.watchdog import Step

log = logging.getLogger(__name__)

CRASH_EXIT_CODE = 3
_ENV_PREFIX = "MLXSERVE_FAULT_"


class InjectedFault(RuntimeError):
    """The exception `MLXSERVE_FAULT_RAISE_AT_STEP` raises inside a step."""


@dataclass(frozen=True)
class Faults:
    """The armed faults: a step index per kind, or None. Field `x` is `MLXSERVE_FAULT_X`."""

    hang_at_step: int | None = None
    crash_at_step: int | None = None
    raise_at_step: int | None = None
    follower_hang_at_step: int | None = None

    def __post_init__(self) -> None:
        for name, value in self.items():
            if value is not None and value < 1:
                raise ValueError(f"{env_name(name)} must be a step index >= 1, got {value}")

    def items(self) -> list[tuple[str, int | None]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    @property
    def armed(self) -> bool:
        return any(value is not None for _, value in self.items())

    def describe(self) -> str:
        """E.g. 'MLXSERVE_FAULT_HANG_AT_STEP=3' (for the log line that warns about them)."""
        return ", ".join(f"{env_name(n)}={v}" for n, v in self.items() if v is not None)


def env_name(field_name: str) -> str:
    return _ENV_PREFIX + field_name.upper()


_override_lock = threading.Lock()
_override: Faults | None = None


def active_faults(environ: Mapping[str, str] | None = None) -> Faults:
    """The faults in force: an active `override_faults`, else the environment.

    Raises ValueError naming the variable when one is not a step index.
    """
    with _override_lock:
        if _override is not None:
            return _override
    env = os.environ if environ is None else environ
    values: dict[str, int | None] = {}
    for field in fields(Faults):
        name = env_name(field.name)
        raw = env.get(name, "").strip()
        if not raw:
            values[field.name] = None
            continue
        try:
            values[field.name] = int(raw)
        except ValueError:
            raise ValueError(f"{name} must be a step index >= 1, got {raw!r}") from None
    return Faults(**values)


@contextmanager
def override_faults(**faults: int | None) -> Iterator[Faults]:
    """Arm faults for the duration of a `with` block, ignoring the environment (tests)."""
    global _override
    armed = Faults(**faults)
    with _override_lock:
        previous, _override = _override, armed
    try:
        yield armed
    finally:
        with _override_lock:
            _override = previous


class FaultInjector:
    """The engine's `before_step` hook that fires the armed faults.

    `exit` and the hang's release event are injectable so the faults can be
    unit-tested in-process; in the engine process they are `os._exit` and an
    event nobody sets.
    """

    def __init__(
        self,
        faults: Faults,
        *,
        exit: Callable[[int], object] = os._exit,
        hang_poll_s: float = 1.0,
    ) -> None:
        self.faults = faults
        self._exit = exit
        self._hang_poll_s = hang_poll_s
        self.release = threading.Event()  # set() ends an injected hang (tests only)

    def __call__(self, step: Step) -> None:
        faults = self.faults
        if step.index == faults.crash_at_step:
            log.error("injected crash at step %d (%s): exiting", step.index, step.kind)
            _flush_logs()
            self._exit(CRASH_EXIT_CODE)
        if step.index == faults.raise_at_step:
            raise InjectedFault(f"injected failure at step {step.index} ({step.kind})")
        if step.index == faults.hang_at_step:
            log.warning("injected hang at step %d (%s): blocking", step.index, step.kind)
            _flush_logs()
            while not self.release.wait(self._hang_poll_s):
                pass


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
