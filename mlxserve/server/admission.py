"""How many requests generate at once, how many may wait, and who is turned away.

A bounded queue in front of the engines: past `max_running` requests wait in
arrival order, past `max_queue` waiting ones the answer is 429 with
Retry-After. A queue without a bound would only turn overload into timeouts.
While draining, nothing new is admitted (503 with Retry-After).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mlxserve.server.errors import QueueFull, ServiceUnavailable
from mlxserve.server.metrics import Metrics


class Admission:
    def __init__(
        self, max_running: int, max_queue: int, retry_after_s: int, metrics: Metrics
    ) -> None:
        self.max_running = max_running
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.running = 0
        self.waiting = 0
        self.draining = False
        self._slots = asyncio.Semaphore(max_running)
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting

    def _check_open(self) -> None:
        if self.draining:
            raise ServiceUnavailable(
                "the server is shutting down", self.retry_after_s, code="shutting_down"
            )

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        self._check_open()
        if self._slots.locked() and self.waiting >= self.max_queue:
            raise QueueFull(
                f"too many requests: {self.running} running and {self.waiting} queued",
                self.retry_after_s,
            )
        self._count(waiting=+1)
        try:
            await self._slots.acquire()
        finally:
            self._count(waiting=-1)
        self._count(running=+1)
        try:
            yield
        finally:
            self._count(running=-1)
            self._slots.release()

    def _count(self, waiting: int = 0, running: int = 0) -> None:
        self.waiting += waiting
        self.running += running
        if self.in_flight == 0:
            self._idle.set()
        else:
            self._idle.clear()
        self._publish()

    def _publish(self) -> None:
        self.metrics.queue_depth.set(self.waiting)
        self.metrics.running.set(self.running)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
