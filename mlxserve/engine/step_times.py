"""How long steps take here, so a hang can be told from a slow step in seconds.

The front declares an engine hung when no step finishes for a multiple of
what such a step usually takes. "Usually" is the p99 of recent steps of the
same kind; a prefill chunk is measured per prompt token, so the first long
chunk after short ones is expected to take as long as its tokens say.
"""

import math
import threading
from collections import deque
from typing import Final

from mlxserve.engine.step_plan import StepKind, StepPlan

WINDOW: Final = 256  # recent steps per kind


class StepTimes:
    """Recent step durations per kind; written by the engine thread, read by any."""

    def __init__(self, window: int = WINDOW) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[StepKind, deque[float]] = {}
        self._window = window

    def record(self, plan: StepPlan, seconds: float) -> None:
        per = seconds / max(plan.num_tokens, 1) if plan.kind == "prefill" else seconds
        with self._lock:
            self._seconds.setdefault(plan.kind, deque(maxlen=self._window)).append(per)

    def clear(self) -> None:
        with self._lock:
            self._seconds.clear()

    def p99(self, kind: StepKind) -> float | None:
        with self._lock:
            recent = sorted(self._seconds.get(kind, ()))
        if not recent:
            return None
        return recent[min(len(recent) - 1, math.ceil(0.99 * len(recent)) - 1)]

    def expected_s(self, plan: StepPlan | None) -> float:
        """The p99 duration of steps like `plan` (0.0: nothing like it measured yet)."""
        if plan is None:
            return max((self.p99(kind) or 0.0) for kind in ("decode", "speculate"))
        p99 = self.p99(plan.kind)
        if p99 is None:
            return 0.0
        return p99 * plan.num_tokens if plan.kind == "prefill" else p99
