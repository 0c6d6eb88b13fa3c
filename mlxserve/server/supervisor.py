"""Keep every backend alive and honestly labelled healthy or not.

For each backend, one task: start it, prove it with a real one-token
generation, then watch it. A local engine that exits (a crash, a kill, or the
watchdog's exit 75) is recorded as an incident, with the hash of the policy
plan it ran under, and restarted with exponential backoff; traffic returns to
it when a probe passes again. An idle backend is probed every
`ready_interval_s`; tokens delivered to clients count as proof of life, so a
busy backend is not probed (a probe would wait behind the real work).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxserve.channel.request import GenerationParams
from mlxserve.config import ServerSettings, state_dir
from mlxserve.errors import UsageError
from mlxserve.reliability.hang import LoopPauses
from mlxserve.reliability.incidents import REMEMBERED, IncidentStore, from_plan
from mlxserve.server.backends.base import (
    Backend,
    BackendRefused,
    BackendRejected,
    BackendUnavailable,
    Finished,
)
from mlxserve.server.backends.local import LocalEngine
from mlxserve.server.metrics import Metrics
from mlxserve.server.progress import Console

log = logging.getLogger(__name__)

WATCHDOG_EXIT = 75
FAILED_PROBES_BEFORE_KILL = 2
TICK_S = 0.5
EXIT_GRACE_S = 5.0
INCIDENTS_KEPT = 100  # the newest; a flapping engine must not grow the front's memory


@dataclass(frozen=True)
class Incident:
    backend: str
    kind: str  # watchdog | hung | crash | killed | unresponsive
    exit_code: int | None
    plan_hash: str
    at: float
    output_tail: tuple[str, ...] = ()
    #: For a hang the front declared: what it saw (`mlxserve.reliability.hang.Evidence`).
    evidence: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        """The incident as `/ready` and `/status` report it (its output tail aside)."""
        return {
            "backend": self.backend,
            "kind": self.kind,
            "exit_code": self.exit_code,
            "plan_hash": self.plan_hash,
            "at": self.at,
            "evidence": self.evidence,
        }


def progress_timeout_s(backend: Backend) -> float:
    """The engine's watchdog timeout, from the plan it announced (0 when unknown)."""
    plan = backend.info.plan if backend.info is not None else None
    try:
        return float(plan["world"]["progress_timeout_s"]["value"]) if plan else 0.0
    except (KeyError, TypeError, ValueError):
        return 0.0


def unreached_overrides(plan: dict[str, Any] | None) -> list[str]:
    """The overrides of an engine's plan that changed nothing, one line each.

    Why: an override that targets decisions no rank may take (``nax_moe=full`` on a
    cluster without a NAX rank) is applied to no rank; `policy explain` shows it, and
    serving must not keep it silent, since the operator believes it is in force."""
    lines = []
    for override in (plan or {}).get("overrides", []):
        if override.get("applied_to") == []:
            rank = override.get("rank")
            key = override.get("key") if rank is None else f"{override.get('key')}@{rank}"
            lines.append(
                f"override {key}={override.get('value')} ({override.get('source')}) reaches "
                "no rank: the decisions it targets are not overridable on this cluster "
                "(mlxserve policy explain shows the plan)"
            )
    return lines


def incident_kind(exit_code: int | None) -> str:
    if exit_code == WATCHDOG_EXIT:
        return "watchdog"
    if exit_code is not None and exit_code < 0:
        return "killed"
    return "crash"


class Supervisor:
    def __init__(
        self,
        backends: list[Backend],
        settings: ServerSettings,
        metrics: Metrics,
        probe_ids: list[int],
        console: Console,
        on_healthy: Callable[[Backend], None] | None = None,
    ) -> None:
        self.backends = backends
        self.settings = settings
        self.metrics = metrics
        self.probe_ids = tuple(probe_ids)
        self.console = console
        self.on_healthy = on_healthy
        self.incidents: deque[Incident] = deque(maxlen=INCIDENTS_KEPT)
        #: The front's own pauses: a probe that timed out while the front did not run
        #: says nothing about the backend. One event loop, one record of its pauses:
        #: the local engines' hang detectors keep it, so it is theirs (`build_backends`).
        self.pauses = (
            next((b.pauses for b in backends if isinstance(b, LocalEngine)), None) or LoopPauses()
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.refused: dict[str, str] = {}  # backend -> why it refuses to start
        #: Set when every backend refused to start: the front cannot serve and exits 2.
        self.all_refused = asyncio.Event()

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.pauses.run(), name="loop-pauses"))
        for backend in self.backends:
            self._tasks.append(asyncio.create_task(self._keep(backend), name=backend.name))

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(backend.stop() for backend in self.backends))

    def _backoff(self, failures: int) -> float:
        base = self.settings.restart_backoff_s * 2 ** max(failures - 1, 0)
        return float(min(self.settings.restart_backoff_max_s, base))

    async def _keep(self, backend: Backend) -> None:
        failures = 0
        starts = 0
        while not self._stopping:
            began = time.monotonic()
            if not backend.connected:
                if starts and isinstance(backend, LocalEngine):
                    self.metrics.engine_restarts.labels(backend.name).inc()
                try:
                    info = await backend.start()
                except BackendRefused as exc:
                    self._refused(backend, str(exc))
                    return
                except BackendUnavailable as exc:
                    failures += 1
                    delay = self._backoff(failures)
                    self.console.say(f"backend '{backend.name}' failed to start: {exc}")
                    self.console.say(f"retrying '{backend.name}' in {delay:.1f} s")
                    await asyncio.sleep(delay)
                    continue
                starts += 1
                self.console.engine_up(backend.name, info, time.monotonic() - began, starts > 1)
                if starts == 1:
                    for line in unreached_overrides(info.plan):
                        log.warning("backend '%s': %s", backend.name, line)
            if await self.probe(backend):
                failures = 0
                self._healthy(backend)
            await self._watch(backend)
            if self._stopping:
                return
            failures += 1
            delay = self._backoff(failures)
            log.info("restarting backend '%s' in %.1f s", backend.name, delay)
            await asyncio.sleep(delay)

    def _refused(self, backend: Backend, reason: str) -> None:
        """An engine that exits 2 has bad settings: never restarted (it would fail forever)."""
        self.refused[backend.name] = reason
        self.console.say(f"backend '{backend.name}' refuses to start (not retried): {reason}")
        if len(self.refused) == len(self.backends):
            self.all_refused.set()

    def _healthy(self, backend: Backend) -> None:
        backend.set_healthy(True)
        if self.on_healthy is not None:
            self.on_healthy(backend)

    async def _watch(self, backend: Backend) -> None:
        """Return when the backend is down (and, for a local engine, has exited)."""
        interval = self.settings.ready_interval_s
        failed_probes = 0
        next_probe = 0.0
        while backend.connected:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            fresh = now - backend.state.last_ok < interval
            if not backend.connected or (fresh and backend.healthy) or now < next_probe:
                continue
            if backend.watches_progress and backend.healthy and backend.state.in_flight:
                continue  # busy: its step counter says whether it lives, a probe would queue
            if await self.probe(backend):
                failed_probes = 0
                self._healthy(backend)
                continue
            failed_probes += 1
            next_probe = time.monotonic() + interval
            backend.set_healthy(False)
            if failed_probes >= FAILED_PROBES_BEFORE_KILL and isinstance(backend, LocalEngine):
                self.console.say(f"backend '{backend.name}' is unresponsive: killing it")
                self._record(backend, "unresponsive", None)
                backend.kill()
                await backend.wait_exit()
                return
        if isinstance(backend, LocalEngine):
            grace = EXIT_GRACE_S
            if backend.hung is not None:  # its own watchdog should end it, with its stacks
                grace += progress_timeout_s(backend)
            try:  # the channel closed; the process should follow
                code = await asyncio.wait_for(backend.wait_exit(), grace)
            except TimeoutError:
                backend.kill()
                code = await backend.wait_exit()
            if not self._stopping and code is not None:
                kind = incident_kind(code)
                if backend.hung is not None and kind != "watchdog":
                    kind = "hung"  # the front saw it first, and the engine never ended itself
                evidence = backend.hung.as_dict() if backend.hung is not None else None
                self._record(backend, kind, code, evidence)

    def _record(
        self,
        backend: Backend,
        kind: str,
        code: int | None,
        evidence: dict[str, Any] | None = None,
    ) -> None:
        plan_hash = backend.info.plan_hash if backend.info else "none"
        tail = tuple(backend.output_tail) if isinstance(backend, LocalEngine) else ()
        at = getattr(backend, "exited_at", None) if code is not None else None
        incident = Incident(backend.name, kind, code, plan_hash, at or time.time(), tail, evidence)
        self.incidents.append(incident)
        if kind in REMEMBERED and backend.info is not None and backend.info.plan:
            self._remember(backend, incident)
        self.metrics.incidents.labels(backend.name, kind, plan_hash[:12]).inc()
        last = " | ".join(line for line in tail[-5:] if line.strip())
        log.error(
            "incident: backend '%s' %s (exit code %s) under policy plan %s; last output: %s",
            backend.name,
            kind,
            code,
            plan_hash,
            last or "(none)",
        )
        exit_note = f" (exit code {code})" if code is not None else ""
        self.console.say(
            f"incident: backend '{backend.name}' {kind}{exit_note}, plan {plan_hash[:12]}"
        )

    def _remember(self, backend: Backend, incident: Incident) -> None:
        """Write the incident to the memory the next plan reads (rule incident-pinned)."""
        assert backend.info is not None and backend.info.plan is not None
        step_kind = backend.step_kind if isinstance(backend, LocalEngine) else None
        record = from_plan(
            backend.info.plan,
            kind=incident.kind,
            backend=backend.name,
            at=incident.at,
            step_kind=step_kind,
            evidence=incident.evidence,
        )
        store = IncidentStore(state_dir(self.settings))
        try:
            store.append(record)
        except (OSError, UsageError) as exc:  # memory is a help, not a reason to stop serving
            log.error("cannot remember the incident in %s: %s", store.path, exc)
            return
        log.info("incident remembered in %s", store.path)

    async def probe(self, backend: Backend) -> bool:
        """A real one-token generation within `ready_timeout_s`; asked again once if the
        front itself paused while it waited (the backend was not the one that was silent)."""
        began = self.pauses.look()
        if await self._probe_once(backend):
            return True
        now = self.pauses.look()
        if self.pauses.paused_within(began, now) > 0 and backend.connected:
            log.info("health probe of '%s' spanned a pause of the front: asked again", backend.name)
            return await self._probe_once(backend)
        return False

    async def _probe_once(self, backend: Backend) -> bool:
        # The model's own stops, as a client's request has them: an empty set asks to
        # ignore EOS, a field a strict OpenAI-compatible remote refuses.
        stops = backend.info.eos_token_ids if backend.info is not None else ()
        params = GenerationParams(prompt_ids=self.probe_ids, max_tokens=1, stop_token_ids=stops)
        stream = backend.generate(f"probe-{uuid.uuid4().hex[:12]}", params)
        try:
            async with asyncio.timeout(self.settings.ready_timeout_s):
                async for event in stream:
                    if isinstance(event, Finished):
                        break
        except (BackendUnavailable, BackendRejected, TimeoutError) as exc:
            log.warning("health probe of '%s' failed: %s", backend.name, exc or "timeout")
            return False
        finally:
            await stream.aclose()
        backend.proof_of_life()
        return True
