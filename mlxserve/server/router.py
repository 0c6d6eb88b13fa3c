"""Send each request to the first healthy backend; resume it elsewhere if that one fails.

Retries use tenacity: a bounded number of attempts, exponential backoff with
full jitter (so the resumed requests of a failed engine do not arrive in one
burst), and only for `BackendUnavailable`; a client's bad request never gets
this far, and neither a backend's refusal (`BackendRejected`) nor a failure of the
request itself (`BackendRequestFailed`: its grammar, a step that raised for it) is
retried: the same inputs fail the same way on any engine.

Resuming a stream: every attempt sends the original prompt plus the tokens the
client already has, with the remaining budget. Greedy decoding then continues
exactly where the failed backend stopped, so the client sees one stream with
no duplicated and no missing tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt
from tenacity import wait_random_exponential as wait_full_jitter

from mlxserve.channel.request import GenerationParams
from mlxserve.server.backends.base import (
    Backend,
    BackendEvent,
    BackendRequestFailed,
    BackendUnavailable,
    Finished,
    Tokens,
)
from mlxserve.server.metrics import Metrics

log = logging.getLogger(__name__)


class NoHealthyBackend(BackendUnavailable):
    """Every backend is down (or the server is draining)."""


@dataclass
class Job:
    """One request as the router tracks it across attempts."""

    request_id: str
    params: GenerationParams
    sent: list[int] = field(default_factory=list)
    attempts: int = 0
    backend: str | None = None

    def resume_params(self) -> GenerationParams:
        return replace(
            self.params,
            prompt_ids=self.params.prompt_ids + tuple(self.sent),
            max_tokens=self.params.max_tokens - len(self.sent),
            grammar_prefix=self.params.grammar_prefix + tuple(self.sent),
        )


@dataclass(frozen=True)
class Switch:
    """Traffic moved from one backend to another (or to the first one up).

    ``kind``: ``failover`` (the active backend failed; traffic went to a later one),
    ``failback`` (an earlier backend that had served and failed is healthy again),
    ``up`` (an earlier backend that never served came up: a start, not a recovery),
    ``first`` (the first backend up), ``none`` (no backend is healthy), ``back`` (the
    backend that served last is healthy again after none was)."""

    at: float  # wall-clock time (time.time())
    kind: str
    from_backend: str | None
    to_backend: str | None


SWITCHES_KEPT = 200  # the newest; a flapping backend must not grow the front's memory


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    backoff_s: float = 0.2
    backoff_max_s: float = 5.0
    #: How long an attempt waits for a healthy backend while every one is down.
    restart_wait_s: float = 30.0


class Router:
    def __init__(self, backends: Sequence[Backend], retry: RetryPolicy, metrics: Metrics) -> None:
        self.backends = list(backends)
        self.retry = retry
        self.metrics = metrics
        self.closed = False
        self._active: Backend | None = None
        self._last_active: Backend | None = None
        #: Backends that have been the active one: only those can fail back.
        self._served: set[str] = set()
        self.switches: deque[Switch] = deque(maxlen=SWITCHES_KEPT)
        self._health_event = asyncio.Event()  # replaced (after being set) on each change
        for index, backend in enumerate(self.backends):
            backend.state.listeners.append(self._health_changed)
            metrics.backend_active.labels(backend.name).set(0)
            metrics.backend_healthy.labels(backend.name).set(int(backend.healthy))
            # Every move that can happen reads 0 until it does (not absent).
            for later in self.backends[index + 1 :]:
                metrics.failovers.labels(backend.name, later.name)
                metrics.failbacks.labels(backend.name)
        self._choose_active()

    @property
    def active(self) -> Backend | None:
        """The backend new requests go to: the first healthy one, in configured order."""
        return self._active

    def _health_changed(self, backend: Backend, healthy: bool) -> None:
        self.metrics.backend_healthy.labels(backend.name).set(int(healthy))
        log.info("backend '%s' is %s", backend.name, "healthy" if healthy else "not healthy")
        self._choose_active()
        self._health_event.set()
        self._health_event = asyncio.Event()

    def _choose_active(self) -> None:
        new = next((b for b in self.backends if b.healthy and b.connected), None)
        if new is self._active:
            return
        for candidate in self.backends:
            self.metrics.backend_active.labels(candidate.name).set(int(candidate is new))
        self._record(self._last_active, new)
        self._active = new
        if new is not None:
            self._last_active = new
            self._served.add(new.name)

    def _record(self, previous: Backend | None, new: Backend | None) -> None:
        """Count and log a move of traffic. A failback is a return to a backend that had
        served and failed: an earlier backend coming up for the first time (the primary
        still loading while a fallback already serves) is a start, counted nowhere."""
        now = time.time()
        if new is None:
            if previous is not None:
                self.switches.append(Switch(now, "none", previous.name, None))
            return
        if previous is None:
            self.switches.append(Switch(now, "first", None, new.name))
            return
        if new is previous:  # the only backend up again after none was
            self.switches.append(Switch(now, "back", None, new.name))
            log.info("traffic back on '%s'", new.name)
            return
        if self.backends.index(new) > self.backends.index(previous):
            self.metrics.failovers.labels(previous.name, new.name).inc()
            self.switches.append(Switch(now, "failover", previous.name, new.name))
            log.warning("failover: '%s' -> '%s'", previous.name, new.name)
        elif new.name in self._served:
            self.metrics.failbacks.labels(new.name).inc()
            self.switches.append(Switch(now, "failback", previous.name, new.name))
            log.info("traffic back on '%s'", new.name)
        else:
            self.switches.append(Switch(now, "up", previous.name, new.name))
            log.info("'%s' is up: traffic moves to it from '%s'", new.name, previous.name)

    def _pick(self, job: Job) -> Backend:
        """The active backend, whichever attempt of ``job`` this is: only a backend's
        own failures are retried (`BackendUnavailable`), and a backend that had one is
        not the active one again until it is healthy again."""
        backend = self._active
        if self.closed or backend is None or not backend.connected:
            raise NoHealthyBackend("no healthy backend")
        return backend

    async def _wait_pick(self, job: Job) -> Backend:
        """`_pick`, waiting up to `restart_wait_s` while no backend is healthy.

        Why: when every backend failed at once (both killed within a second),
        each is back within seconds, but the retry budget (about 1.4 s of backoff)
        is spent before a restart is. Waiting here does not use up attempts; the
        request then resumes exactly, with the tokens the client already has.
        """
        deadline = time.monotonic() + self.retry.restart_wait_s
        while True:
            try:
                return self._pick(job)
            except NoHealthyBackend:
                left = deadline - time.monotonic()
                if self.closed or left <= 0:
                    raise
            changed = self._health_event
            if job.attempts and not changed.is_set():
                log.info("request %s waits for a healthy backend", job.request_id)
            try:
                async with asyncio.timeout(min(left, 1.0)):
                    await changed.wait()
            except TimeoutError:
                pass  # look again: the deadline, and draining, are checked at the top

    def _retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop_after_attempt(self.retry.attempts),
            wait=wait_full_jitter(multiplier=self.retry.backoff_s, max=self.retry.backoff_max_s),
            retry=retry_if_exception_type(BackendUnavailable),
            reraise=True,
        )

    async def generate(self, job: Job) -> AsyncGenerator[BackendEvent, None]:
        """Tokens (as the client should see them) and one `Finished`, across failovers.

        Raises `BackendUnavailable` (or `NoHealthyBackend`) when the attempts run out.
        """
        async for attempt in self._retrying():
            with attempt:
                async for event in self._attempt(job):
                    yield event

    async def _attempt(self, job: Job) -> AsyncGenerator[BackendEvent, None]:
        backend = await self._wait_pick(job)
        job.attempts += 1
        if job.attempts > 1:
            log.info(
                "request %s resumes on '%s' after %d token(s)",
                job.request_id,
                backend.name,
                len(job.sent),
            )
        job.backend = backend.name
        if len(job.sent) >= job.params.max_tokens:  # the failure came after the last token
            yield Finished("length", len(job.params.prompt_ids), len(job.sent))
            return
        stream = backend.generate(f"{job.request_id}.{job.attempts}", job.resume_params())
        try:
            async for event in stream:
                if isinstance(event, Tokens):
                    job.sent.extend(event.token_ids)
                yield event
        except BackendUnavailable as exc:
            self.metrics.retries.labels(backend.name).inc()
            log.warning("request %s failed on '%s': %s", job.request_id, backend.name, exc)
            raise
        except BackendRequestFailed as exc:
            log.warning(
                "request %s failed on '%s', not retried (its own failure): %s",
                job.request_id,
                backend.name,
                exc,
            )
            raise
        finally:
            await stream.aclose()

    async def cancel_all(self) -> None:
        for backend in self.backends:
            if backend.connected:
                await backend.cancel_all()
