"""A small bounded thread pool for the front's CPU work: preparing a request.

Why: chat templating, the DeepSeek-V4 encoder, tokenization and grammar building
take time in proportion to the request (seconds for a prompt of megabytes), and
on the event loop they stall every stream, ``/health`` and the engines' channels
while they run. In a thread they do not: the tokenizer (Rust) releases the GIL
while it encodes, and Python code (templates, encoders) yields the GIL every few
milliseconds. JSON parsing and pydantic validation stay on the loop: they hold
the GIL in one C call, so a thread would not shorten the stall, and the body
size limit bounds them (tens of milliseconds).

Bounded so that many large requests at once cannot pile up work or memory:
`threads` jobs run at a time (a tokenizer's working memory for a long prompt is
many times its text, so this caps that too); the others wait in arrival order,
at most `max_waiting` of them, and the request bodies of all the jobs (each holds
its body and its parsed copies until done) at most `max_bytes` together, except
that a lone job is always taken. Past either bound the request gets 429
(``queue_full``, with Retry-After) in its API's error shape, as when the
engines' queue is full.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from mlxserve.server.errors import QueueFull

P = ParamSpec("P")
R = TypeVar("R")

#: Threads preparing requests. Two keep one long tokenization from holding up
#: short requests without taking cores from engines that run on the same machine.
THREADS = 2
#: The bodies the jobs may hold together, in largest bodies (``max_body_bytes``):
#: 32 MiB at the default 4 MiB limit.
BODIES = 8


class Workers:
    def __init__(self, threads: int, max_waiting: int, max_bytes: int, retry_after_s: int) -> None:
        self.threads = threads
        self.max_waiting = max_waiting
        self.max_bytes = max_bytes
        self.retry_after_s = retry_after_s
        self._pending = 0  # running and waiting jobs; released from the worker thread
        self._bytes = 0  # their request bodies
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started by the first job
        self._closed = False

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def pending_bytes(self) -> int:
        return self._bytes

    async def run(self, size: int, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """``fn(*args, **kwargs)`` in a worker thread, for a request of `size` bytes; its
        result or its exception, or `QueueFull` at once past the bounds.

        If the caller is cancelled, a job not started yet never runs; a started one
        finishes in its thread and still counts until then.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            if self._pending >= self.threads + self.max_waiting or (
                self._pending and self._bytes + size > self.max_bytes
            ):
                raise QueueFull(
                    f"too many requests being prepared: {self._pending} holding "
                    f"{self._bytes} bytes ({self.threads} at a time, {self.max_waiting} "
                    f"waiting, {self.max_bytes} bytes)",
                    self.retry_after_s,
                )
            self._pending += 1
            self._bytes += size
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="prepare")
            pool = self._pool
        release = functools.partial(self._release, size)
        try:
            future = pool.submit(fn, *args, **kwargs)
        except BaseException:
            release()
            raise
        future.add_done_callback(release)
        return await asyncio.wrap_future(future)

    def _release(self, size: int, _: Future[Any] | None = None) -> None:
        with self._lock:
            self._pending -= 1
            self._bytes -= size

    def shutdown(self) -> None:
        """Refuse new jobs and drop waiting ones; running ones end in their threads."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
