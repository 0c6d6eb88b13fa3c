"""Everything one serving front owns, wired together: backends, router, admission, metrics.

Built from settings by `Runtime.from_settings`; tests build one from their own
backends. The HTTP app only reads from it, the serve command starts, drains and
stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from mlxserve.cluster.launch import launcher_command
from mlxserve.config import FallbackSettings, Settings, state_dir
from mlxserve.reliability.hang import LoopPauses
from mlxserve.server.admission import Admission
from mlxserve.server.backends.base import Backend
from mlxserve.server.backends.local import LocalEngine
from mlxserve.server.backends.remote import RemoteBackend
from mlxserve.server.generation import Generations
from mlxserve.server.history import History
from mlxserve.server.metrics import Metrics
from mlxserve.server.progress import Console
from mlxserve.server.router import RetryPolicy, Router
from mlxserve.server.supervisor import Supervisor
from mlxserve.server.tokenizer import FrontTokenizer
from mlxserve.server.workers import BODIES, THREADS, Workers

log = logging.getLogger(__name__)

#: Settings sections an engine reads; the front resolves them and hands them over whole.
ENGINE_SECTIONS = ("policy", "cluster", "engine", "speculative")
PROBE_TEXT = "Hello"
DEFAULT_CONTEXT = 4096


def engine_env(settings: Settings, model: str, overrides: list[str] | None) -> dict[str, str]:
    """The engine's settings as MLXSERVE_* variables (JSON per section).

    Why not the config file: the front's settings may come from flags and the
    environment too, and a fallback engine differs in model and policy; resolved
    values leave nothing for the child to re-derive differently.
    """
    data = settings.model_dump(mode="json", include=set(ENGINE_SECTIONS))
    if overrides is not None:
        data["policy"]["overrides"] = overrides
        # A fallback engine: [cluster] split is the primary group's; its plan chooses its own.
        data["cluster"]["split"] = None
    env = {f"MLXSERVE_{name.upper()}": json.dumps(data[name]) for name in ENGINE_SECTIONS}
    env["MLXSERVE_MODEL"] = model
    # The plan reads the incident memory the front writes: the same place for both.
    env["MLXSERVE_SERVER__STATE_DIR"] = str(state_dir(settings.server))
    return env


def inherited_env() -> dict[str, str]:
    """The front's environment minus its own MLXSERVE_* settings (the child gets resolved ones)."""
    fields = {name.upper() for name in Settings.model_fields}
    return {
        key: value
        for key, value in os.environ.items()
        if not (key.startswith("MLXSERVE_") and key[len("MLXSERVE_") :].split("__")[0] in fields)
    }


async def open_a_task_group() -> None:
    """Open and close one anyio task group, at start-up. Starlette streams every
    response inside one, and anyio imports its asyncio back-end when the first is
    opened: about 15 ms on the project's CPU, which the first streamed request's
    time to first token paid (`benchmarks/first_request.py`)."""
    import anyio  # starlette's own foundation

    async with anyio.create_task_group():
        pass


def build_backends(settings: Settings, tokenizer: FrontTokenizer) -> list[Backend]:
    """The primary and the fallbacks; the local engines share one record of the front's
    event-loop pauses (`mlxserve.reliability.hang.LoopPauses`)."""
    server = settings.server
    pauses = LoopPauses()
    backends: list[Backend] = [
        LocalEngine(
            "primary",
            env={
                **inherited_env(),
                **engine_env(settings, settings.model, None),
                **server.engine_env,
            },
            startup_timeout_s=server.startup_timeout_s,
            request_timeout_s=server.request_timeout_s,
            hang_floor_s=server.hang_floor_s,
            launcher=group_launcher(settings, settings.cluster.hosts),
            pauses=pauses,
        )
    ]
    for index, fallback in enumerate(settings.fallback, start=1):
        backends.append(_fallback(settings, fallback, f"fallback{index}", tokenizer, pauses))
    return backends


def _fallback(
    settings: Settings,
    entry: FallbackSettings,
    default: str,
    tokenizer: FrontTokenizer,
    pauses: LoopPauses,
) -> Backend:
    server = settings.server
    name = entry.name or default
    if entry.url is not None:
        return RemoteBackend(
            name,
            entry.url,
            tokenizer=tokenizer,
            api_key=entry.api_key,
            request_timeout_s=server.request_timeout_s,
            context_length=DEFAULT_CONTEXT,
        )
    assert entry.model is not None
    return LocalEngine(
        name,
        env={**inherited_env(), **engine_env(settings, entry.model, entry.policy), **entry.env},
        startup_timeout_s=server.startup_timeout_s,
        request_timeout_s=server.request_timeout_s,
        hang_floor_s=server.hang_floor_s,
        launcher=group_launcher(settings, entry.hosts),
        pauses=pauses,
    )


def group_launcher(
    settings: Settings, hosts: list[str]
) -> Callable[[Mapping[str, str]], list[str]] | None:
    """For a backend on several hosts: how to launch its group (None: a single engine)."""
    if not hosts:
        return None
    backend = "ring" if settings.cluster.backend == "auto" else settings.cluster.backend
    return functools.partial(launcher_command, hosts, backend)


def backends_line(backends: list[Backend]) -> str:
    """Which backends are up and which are not yet, for the operator's terminal."""
    up = [f"'{b.name}'" for b in backends if b.healthy]
    down = [f"'{b.name}'" for b in backends if not b.healthy]
    line = f"up: {', '.join(up) or 'none'}"
    return f"{line}; not up yet: {', '.join(down)}" if down else line


class Runtime:
    def __init__(
        self,
        settings: Settings,
        tokenizer: FrontTokenizer,
        backends: list[Backend],
        console: Console | None = None,
    ) -> None:
        server = settings.server
        self.settings = settings
        self.tokenizer = tokenizer
        self.console = console or Console(enabled=False)
        self.metrics = Metrics()
        self.model_name = server.model_name or settings.model
        #: Every other name a request may send as `model`: the aliases (listed by
        #: /v1/models), then the model setting itself (a directory's full path) when a
        #: served name hides it.
        self.model_aliases = tuple(
            dict.fromkeys(
                name for name in (*server.model_aliases, settings.model) if name != self.model_name
            )
        )
        self.created = int(time.time())
        self._announced_up: set[str] = set()
        self.url: str | None = None
        retry = RetryPolicy(
            server.retry_attempts,
            server.retry_backoff_s,
            server.retry_backoff_max_s,
            server.restart_wait_s,
        )
        self.router = Router(backends, retry, self.metrics)
        self.admission = Admission(
            settings.engine.max_running, server.max_queue, server.retry_after_s, self.metrics
        )
        # Preparing requests (templates, tokenizing) runs off the event loop; as many may
        # wait for it as could wait for a slot after it, holding a few bodies' worth.
        self.workers = Workers(
            THREADS,
            settings.engine.max_running + server.max_queue,
            BODIES * server.max_body_bytes,
            server.retry_after_s,
        )
        self.generations = Generations(
            tokenizer=tokenizer,
            router=self.router,
            admission=self.admission,
            metrics=self.metrics,
            model_name=self.model_name,
            aliases=self.model_aliases,
            context_length=self.context_length,
            stop_token_ids=self.stop_token_ids,
            retry_after_s=server.retry_after_s,
        )
        self.history = History(
            self.metrics,
            self.router,
            self.admission,
            interval_s=server.status_sample_s,
            keep=server.status_history_samples,
        )
        self._history_task: asyncio.Task[None] | None = None
        probe = tokenizer.text_ids(PROBE_TEXT) or tokenizer.eos_token_ids[:1]
        self.supervisor = Supervisor(
            self.router.backends, server, self.metrics, probe, self.console, self._on_healthy
        )

    @property
    def backends(self) -> list[Backend]:
        return self.router.backends

    def context_length(self) -> int | None:
        """The smallest context of the backends heard from (a request must fit any of them)."""
        known = [b.info.context_length for b in self.backends if b.info is not None]
        return min(known) if known else None

    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids as the engines announced them in their hello (else the tokenizer's)."""
        announced = {t for b in self.backends if b.info is not None for t in b.info.eos_token_ids}
        return tuple(sorted(announced or set(self.tokenizer.eos_token_ids)))

    def plan(self) -> dict[str, Any] | None:
        """The policy plan of the active backend (else the last one any engine reported)."""
        ordered = [self.router.active, *self.backends]
        for backend in ordered:
            if backend is not None and backend.info is not None and backend.info.plan:
                return backend.info.plan
        return None

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready: not draining, and the active backend proved itself within three intervals."""
        now = time.monotonic()
        window = 3 * self.settings.server.ready_interval_s
        active = self.router.active
        detail: dict[str, Any] = {
            "active": active.name if active else None,
            "draining": self.admission.draining,
            "backends": [
                {
                    "name": b.name,
                    "kind": b.kind,
                    "healthy": b.healthy,
                    "last_ok_seconds_ago": round(now - b.state.last_ok, 3)
                    if b.state.last_ok
                    else None,
                    "in_flight": b.state.in_flight,
                    "pid": getattr(b, "pid", None),
                }
                for b in self.backends
            ],
            "incidents": [i.summary() for i in self.supervisor.incidents],
        }
        ready = (
            not self.admission.draining
            and active is not None
            and now - active.state.last_ok <= window
        )
        detail["status"] = "ready" if ready else "not ready"
        return ready, detail

    def _on_healthy(self, backend: Backend) -> None:
        """Say "ready" once, naming the backends that are up and those still starting (with
        a fallback, the fallback may be up first: "ready" must not read as the primary's);
        then say so when another backend first comes up."""
        if self.url is None:
            return
        if backend.name in self._announced_up:
            return
        self._announced_up.add(backend.name)
        if len(self._announced_up) == 1:
            self.console.ready(self.url, self.model_name, backends_line(self.backends))
            return
        active = self.router.active
        where = "new requests go to it" if active is backend else "standing by"
        self.console.say(
            f"backend '{backend.name}' is up ({where}); {backends_line(self.backends)}"
        )

    async def start(self) -> None:
        await open_a_task_group()
        await self.supervisor.start()
        self._history_task = asyncio.create_task(self.history.run(), name="status-history")

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; let in-flight requests finish within `timeout_s`, then cancel them.

        Returns True if everything finished in time.
        """
        self.admission.draining = True
        if await self.admission.wait_idle(timeout_s):
            return True
        log.warning("drain timeout: cancelling %d request(s)", self.admission.in_flight)
        self.router.closed = True
        await self.router.cancel_all()
        await self.admission.wait_idle(5.0)
        return False

    async def stop(self) -> None:
        if self._history_task is not None:
            self._history_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._history_task
        self.workers.shutdown()
        await self.supervisor.stop()
