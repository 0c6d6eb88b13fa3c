"""Ctrl-C and SIGTERM in a tensor-parallel group: counted, and only the last one exits.

Every process of a group gets the signal (a terminal's Ctrl-C reaches the whole
process group; `mlx.launch` forwards it to each rank). Rank 0 then drains and
tells the other ranks to stop, so the launcher and the follower ranks must not
die on the first signal: they count them and wait for that stop, and leave at
once (`os._exit`, no cleanup that could hang) only when the signals keep coming.
"""

import os
import signal
from collections.abc import Callable
from types import FrameType


class SignalCounter:
    """Counts SIGINT/SIGTERM; the `exit_at`-th ends the process with `exit_code`
    (by default 128 + that signal). `on_wait` is told of each signal before then."""

    def __init__(
        self,
        exit_at: int,
        *,
        exit_code: int | None = None,
        on_wait: Callable[[int], None] | None = None,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        if exit_at < 1:
            raise ValueError(f"exit_at must be at least 1, got {exit_at}")
        self.exit_at = exit_at
        self.exit_code = exit_code
        self.on_wait = on_wait
        self._exit = exit
        self.received = 0

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        self.received += 1
        if self.received >= self.exit_at:
            self._exit(128 + signum if self.exit_code is None else self.exit_code)
        elif self.on_wait is not None:
            self.on_wait(signum)
