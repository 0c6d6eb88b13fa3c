"""How long steps take here, so a hang can be told from a slow step in seconds.

The front declares an engine hung when no step finishes for a multiple of
what such a step usually takes. "Usually" is the p99 of recent steps of the
same kind; a prefill chunk is measured per prompt token, so the first long
chunk after short ones is expected to take as long as its tokens say.

Where kernels compile on their first use (MLX's CUDA backend), the first step
of a shape never run before (a kind at a batch size and draft count) takes
seconds, however fast its kind usually is; ``cold_s`` is what such a step is
expected to take there (0 where nothing compiles, e.g. a CPU).
"""

import math
import threading
from collections import deque
from typing import Final

from mlxserve.engine.step_plan import StepKind, StepPlan

WINDOW: Final = 256  # recent steps per kind

Shape = tuple[StepKind, int, int]


def shape(plan: StepPlan) -> Shape:
    """What a step compiles for: its kind, rows and (but for prefill) tokens per row."""
    return plan.kind, len(plan.request_ids), 0 if plan.kind == "prefill" else plan.num_tokens


class StepTimes:
    """Recent step durations per kind; written by the engine thread, read by any."""

    def __init__(self, window: int = WINDOW, cold_s: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[StepKind, deque[float]] = {}
        self._window = window
        self.cold_s = cold_s
        self._seen: set[Shape] = set()

    def record(self, plan: StepPlan, seconds: float) -> None:
        per = seconds / max(plan.num_tokens, 1) if plan.kind == "prefill" else seconds
        with self._lock:
            self._seconds.setdefault(plan.kind, deque(maxlen=self._window)).append(per)
            self._seen.add(shape(plan))

    def clear(self) -> None:
        """Forget the durations (a warm-up's include its compiling), not the shapes
        already run (compiled)."""
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
        expected = 0.0 if p99 is None else p99 * plan.num_tokens if plan.kind == "prefill" else p99
        if self.cold_s > 0:
            with self._lock:
                cold = shape(plan) not in self._seen
            if cold:
                return max(expected, self.cold_s)
        return expected
