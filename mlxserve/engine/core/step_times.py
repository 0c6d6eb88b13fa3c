"""How long steps take here, so a hang can be told from a slow step in seconds.

The front declares an engine hung when no step finishes for a multiple of
what such a step usually takes. "Usually" is the p99 of recent steps of the
same kind; a prefill chunk is measured per prompt token, so the first long
chunk after short ones is expected to take as long as its tokens say.

Where kernels compile on their first use (MLX's CUDA backend), any work on a
shape never run before (a new batch size, draft count, stacked-cache width, MTP
backlog: inside a step or between steps) takes seconds, however fast such work
usually is, and the shapes are too many to list. ``floor_s`` is the least time
any step is allowed there, whether or not it meets a new shape (0 where nothing
compiles, e.g. a CPU), so the front's hang limit never drops below what a
compile takes.
"""

import math
import threading
from collections import deque
from typing import Final

from mlxserve.engine.core.step import Step, StepKind

WINDOW: Final = 256  # recent steps per kind


class StepTimes:
    """Recent step durations per kind; written by the engine thread, read by any."""

    def __init__(self, window: int = WINDOW, floor_s: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[StepKind, deque[float]] = {}
        self._window = window
        self.floor_s = floor_s

    def record(self, step: Step, seconds: float) -> None:
        per = seconds / max(step.num_tokens, 1) if step.kind == "prefill" else seconds
        with self._lock:
            self._seconds.setdefault(step.kind, deque(maxlen=self._window)).append(per)

    def clear(self) -> None:
        """Forget the durations (a warm-up's include its compiling)."""
        with self._lock:
            self._seconds.clear()

    def p99(self, kind: StepKind) -> float | None:
        with self._lock:
            recent = sorted(self._seconds.get(kind, ()))
        if not recent:
            return None
        return recent[min(len(recent) - 1, math.ceil(0.99 * len(recent)) - 1)]

    def expected_s(self, step: Step | None) -> float:
        """The p99 duration of steps like `step` (None: between steps), at least
        ``floor_s`` (0.0: nothing like it measured yet, nothing compiles)."""
        if step is None:
            expected = max((self.p99(kind) or 0.0) for kind in ("decode", "speculate"))
        else:
            p99 = self.p99(step.kind)
            expected = 0.0 if p99 is None else p99
            if step.kind == "prefill":
                expected *= step.num_tokens
        return max(expected, self.floor_s)
