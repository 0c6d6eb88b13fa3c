"""A local engine: a child process spoken to over a unix socket.

Why a child process: a wedged MLX step cannot be interrupted, only killed; the
front must survive that. The socket lives in a private temporary directory
(mode 0700) and the engine makes it 0600, so only this user can reach it. One
connection carries every request, multiplexed by request id. The child runs in
its own session, so a Ctrl-C in the terminal reaches the front only, and the
front decides when engines stop (after draining).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping
from pathlib import Path

from pydantic import ValidationError

from mlxserve.channel.messages import (
    Cancel,
    Error,
    Finish,
    Generate,
    Hello,
    Progress,
    Status,
    StatusRequest,
    decode_engine,
    encode,
)
from mlxserve.channel.messages import Tokens as Tokens_
from mlxserve.channel.request import GenerationParams
from mlxserve.reliability.hang import EngineStatus, Evidence, HangDetector, LoopPauses
from mlxserve.server.backends.base import (
    Backend,
    BackendError,
    BackendEvent,
    BackendInfo,
    BackendRefused,
    BackendRequestFailed,
    BackendUnavailable,
    Finished,
    Tokens,
)

log = logging.getLogger(__name__)

FAULT_PREFIX = "MLXSERVE_FAULT_"
LINE_LIMIT = 64 << 20  # a Generate line carries the whole prompt
STOP_GRACE_S = 5.0
OUTPUT_TAIL_LINES = 80
OUTPUT_GRACE_S = 2.0
EXIT_USAGE = 2  # the engine's "bad settings" exit: restarting it cannot help
HANG_TICK_S = 0.1  # how often the step counter is checked while requests wait
VERIFY_S = 1.0  # how long a suspected engine has to answer a status request
WAIT_TICK_S = 1.0  # how often a waiting request checks the engine's signs of life


class _Check:
    """A waiting request's turn to look at the engine's signs of life (`generate`)."""


CHECK = _Check()
# An error: how this request ended, whose failure; CHECK: time to look at the engine.
_Item = BackendEvent | BackendError | _Check


def _signal_group(proc: asyncio.subprocess.Process, sig: int) -> None:
    """Signal the child's whole process group: the engine, or a launcher and its ranks.

    The child leads a process group of its own, so its group is exactly what it
    started. Not a session of its own: Linux's autogroup scheduling gives every
    session one share of the CPU, and an engine in another session than the front
    left the front waiting for that share on a busy CPU: a whole generation (tens
    of ms) between the engine's first token and the front reading it.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class LocalEngine(Backend):
    kind = "local"

    def __init__(
        self,
        name: str,
        *,
        env: Mapping[str, str],
        startup_timeout_s: float,
        request_timeout_s: float,
        hang_floor_s: float = 3.0,
        python: str = sys.executable,
        launcher: Callable[[Mapping[str, str]], list[str]] | None = None,
        pauses: LoopPauses | None = None,
    ) -> None:
        super().__init__(name)
        #: For a tensor-parallel group: the launcher command the engine command follows
        #: (`mlxserve.cluster.launch ... --`), made afresh at each start.
        self._launcher = launcher
        if launcher is not None:
            self.kind = "group"
        self._env = dict(env)
        self._startup_timeout_s = startup_timeout_s
        self._request_timeout_s = request_timeout_s
        self.pauses = pauses or LoopPauses(tick_s=HANG_TICK_S)
        self.detector = HangDetector(hang_floor_s, self.pauses)
        self._python = python
        self._starts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._dir: Path | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._relay: asyncio.Task[None] | None = None
        self._streams: dict[str, asyncio.Queue[_Item]] = {}
        self._status_waiters: deque[asyncio.Future[Status]] = deque()
        self._connected = False
        self._stopping = False  # a lost connection during stop() is expected, not a warning
        self._exited = asyncio.Event()
        self.exit_code: int | None = None
        self.exited_at: float | None = None
        self.output_tail: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
        #: Set when the front declared this engine hung (a verified hang): why.
        self.hung: Evidence | None = None

    # -- lifecycle ------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def child_env(self) -> dict[str, str]:
        """The engine's environment; fault injection only on the first start.

        Why: a test injects one fault; the restarted engine must come back healthy
        rather than fail the same way forever.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith(FAULT_PREFIX)}
        for key, value in self._env.items():
            if key.startswith(FAULT_PREFIX) and self._starts > 1:
                continue
            env[key] = value
        return env

    async def start(self) -> BackendInfo:
        await self.stop()
        self._starts += 1
        self._exited = asyncio.Event()
        self.exit_code = None
        self.hung = None
        self.detector.reset(self.pauses.look())
        self.output_tail.clear()
        self._dir = Path(tempfile.mkdtemp(prefix="mlxserve-engine-"))  # mode 0700
        socket_path = self._dir / "engine.sock"
        env = self.child_env()
        command = [self._python, "-m", "mlxserve.engine", "--socket", str(socket_path)]
        if self._launcher is not None:
            command = [*self._launcher(env), "--", *command]
        self._proc = await asyncio.create_subprocess_exec(
            *command,
            # A launcher polls its stdin: a pipe nobody writes keeps that poll asleep.
            stdin=asyncio.subprocess.PIPE if self._launcher else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            process_group=0,
        )
        self._relay = asyncio.create_task(
            self._relay_output(self._proc), name=f"{self.name}-output"
        )
        self._tasks = [
            self._relay,
            asyncio.create_task(self._watch_exit(self._proc), name=f"{self.name}-exit"),
        ]
        try:
            hello = await asyncio.wait_for(
                self._connect(socket_path), timeout=self._startup_timeout_s
            )
        except TimeoutError:
            await self.stop()
            raise BackendUnavailable(
                f"engine '{self.name}' did not start within {self._startup_timeout_s:g} s"
            ) from None
        except BackendUnavailable:
            await self.stop()
            raise
        self.info = BackendInfo(
            model=hello.model,
            context_length=hello.context_length,
            eos_token_ids=tuple(hello.eos_token_ids),
            speculative_depth=hello.speculative_depth,
            speculative_auto=hello.speculative_auto,
            plan=hello.plan,
            pid=hello.pid,
        )
        return self.info

    async def _connect(self, socket_path: Path) -> Hello:
        while True:
            if self._exited.is_set():
                kind = BackendRefused if self.exit_code == EXIT_USAGE else BackendUnavailable
                raise kind(
                    f"engine '{self.name}' exited with code {self.exit_code} while starting"
                    + self._tail_hint()
                )
            if socket_path.exists():
                try:
                    reader, writer = await asyncio.open_unix_connection(
                        str(socket_path), limit=LINE_LIMIT
                    )
                    break
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
            await asyncio.sleep(0.05)
        line = await reader.readline()
        try:
            hello = decode_engine(line)
        except ValidationError:
            writer.close()
            raise BackendUnavailable(
                f"engine '{self.name}' did not say hello: {line[:200]!r}"
            ) from None
        if not isinstance(hello, Hello):
            writer.close()
            raise BackendUnavailable(f"engine '{self.name}' sent {hello.type} before hello")
        self._writer = writer
        self._connected = True
        self._tasks.append(asyncio.create_task(self._read(reader), name=f"{self.name}-read"))
        self._tasks.append(asyncio.create_task(self._watch_steps(), name=f"{self.name}-hang"))
        self._tasks.append(asyncio.create_task(self._tick_waiting(), name=f"{self.name}-wait"))
        return hello

    async def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                _signal_group(proc, signal.SIGKILL)
                await proc.wait()
        self._lost("stopped")
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self._stopping = False

    async def wait_exit(self) -> int | None:
        await self._exited.wait()
        return self.exit_code

    def kill(self) -> None:
        """Kill the process (an unresponsive engine); the exit path does the rest."""
        if self._proc is not None and self._proc.returncode is None:
            _signal_group(self._proc, signal.SIGKILL)

    # -- the child's output and exit --------------------------------------------------

    async def _relay_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            self.output_tail.append(text)
            # The engine's lines carry their own prefix and pid; pass them through as they are.
            print(text, file=sys.stderr, flush=True)

    async def _watch_exit(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        self.exited_at = time.time()
        if self._launcher is not None:  # ranks of this host left behind by a killed launcher
            _signal_group(proc, signal.SIGKILL)
        # Let the output relay catch the last lines (e.g. the watchdog's diagnostic).
        if self._relay is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._relay), OUTPUT_GRACE_S)
        self.exit_code = code
        self._lost(f"exited with code {code}")
        self._exited.set()

    def _tail_hint(self) -> str:
        tail = [line for line in self.output_tail if line.strip()][-3:]
        return (": " + " | ".join(tail)) if tail else ""

    # -- hang detection --------------------------------------------------------------------

    @property
    def watches_progress(self) -> bool:
        return True

    @property
    def step_kind(self) -> str | None:
        """The kind of the step last reported in flight (for the incident record)."""
        return self.detector.step_kind

    async def _watch_steps(self) -> None:
        """Declare the engine hung when it owes requests and its step counter stops.

        Why here and not only the engine's watchdog: that one must wait out the
        slowest legitimate step of any cluster (tens of seconds); the front knows
        this engine's own step times and can fail over in a few seconds. A
        suspicion is verified by asking the engine before anything is declared
        (`mlxserve.reliability.hang`). The engine is left to its watchdog, which
        dumps its stacks before it exits.
        """
        detector = self.detector
        while self._connected:
            await asyncio.sleep(HANG_TICK_S)
            if not (self._connected and detector.suspect(self.pauses.look())):
                continue
            status: EngineStatus | None = None
            try:
                answer = await self.status(VERIFY_S)
                status = EngineStatus(answer.running, answer.queued, answer.progress)
            except TimeoutError:
                pass  # frozen: not even its socket thread answers
            except BackendUnavailable:
                return  # gone meanwhile: the exit path takes over
            now = self.pauses.look()
            if not (self._connected and detector.suspect(now)):
                continue  # the front paused meanwhile, or a step finished
            evidence = detector.verdict(status, now)
            if evidence is None:
                continue
            self.hung = evidence
            log.warning(
                "engine '%s' is hung: %s; its requests resume elsewhere",
                self.name,
                evidence.summary(),
            )
            self._lost(f"hung (no step finished for {evidence.stalled_for_s:.1f} s)")
            return

    async def _tick_waiting(self) -> None:
        """Every WAIT_TICK_S, each request whose queue is empty (it waits for the engine)
        gets a CHECK: its turn to see whether the engine still shows signs of life. One
        timer per engine, not one per token: a timeout around every wait for a token
        (`asyncio.timeout`) made and cancelled a timer on each of them."""
        while self._connected:
            await asyncio.sleep(WAIT_TICK_S)
            for queue in self._streams.values():
                if queue.empty():
                    queue.put_nowait(CHECK)

    # -- the channel ---------------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                try:
                    message = decode_engine(line)
                except ValidationError:
                    log.warning("engine '%s' sent an unreadable line: %r", self.name, line[:200])
                    continue
                self._dispatch(message)
        except (ConnectionError, ValueError) as exc:  # ValueError: line over the limit
            log.warning("engine '%s' channel failed: %s", self.name, exc)
        self._lost("connection closed")

    def _dispatch(self, message: object) -> None:
        if isinstance(message, Tokens_):
            queue = self._streams.get(message.id)
            self.detector.heard(time.monotonic())
            if queue is not None:
                self.proof_of_life()
                queue.put_nowait(Tokens(tuple(message.token_ids), message.logprobs))
        elif isinstance(message, Finish):
            self.detector.done(message.id)
            self.detector.heard(time.monotonic())
            queue = self._streams.get(message.id)
            if queue is None:
                return
            if message.finish_reason == "error":
                queue.put_nowait(
                    BackendRequestFailed(f"engine '{self.name}': {message.error or 'step failed'}")
                )
                return
            self.proof_of_life()
            queue.put_nowait(
                Finished(
                    reason=message.finish_reason,
                    prompt_tokens=message.prompt_tokens,
                    completion_tokens=message.completion_tokens,
                    cached_tokens=message.cached_tokens,
                    speculative=message.speculative,
                    memory=message.memory,
                )
            )
        elif isinstance(message, Progress):
            moved = message.steps != self.detector.steps
            self.detector.progress(
                message.steps, message.expected_step_s, message.step_kind, time.monotonic()
            )
            if moved:
                self.proof_of_life()
        elif isinstance(message, Status):
            self.detector.heard(time.monotonic())
            if self._status_waiters:
                waiter = self._status_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(message)
        elif isinstance(message, Error):
            log.warning("engine '%s' reported: %s", self.name, message.message)
            queue = self._streams.get(message.id) if message.id else None
            if message.id:
                self.detector.done(message.id)
            if queue is not None:
                queue.put_nowait(BackendRequestFailed(f"engine '{self.name}': {message.message}"))

    def _lost(self, reason: str) -> None:
        if self._connected:
            level = logging.INFO if self._stopping else logging.WARNING
            log.log(level, "engine '%s' is gone: %s", self.name, reason)
        self._connected = False
        self.set_healthy(False)
        self.detector.owed.clear()  # a lost engine owes nothing; a restart starts afresh
        error = BackendUnavailable(f"engine '{self.name}' {reason}")
        for queue in self._streams.values():
            queue.put_nowait(error)
        for waiter in self._status_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._status_waiters.clear()

    def _send(self, message: Generate | Cancel | StatusRequest) -> None:
        if self._writer is None or not self._connected:
            raise BackendUnavailable(f"engine '{self.name}' is not connected")
        self._writer.write(encode(message))

    async def status(self, timeout: float = 5.0) -> Status:
        waiter: asyncio.Future[Status] = asyncio.get_running_loop().create_future()
        self._status_waiters.append(waiter)
        self._send(StatusRequest())
        return await asyncio.wait_for(waiter, timeout)

    async def generate(
        self, request_id: str, params: GenerationParams
    ) -> AsyncGenerator[BackendEvent, None]:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id} is already in flight")
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        started = time.monotonic()
        self._streams[request_id] = queue
        finished = False
        self.state.in_flight += 1
        try:
            self.detector.sent(request_id, started)
            self._send(Generate(id=request_id, params=params))
            while True:
                # No timeout per token: `_tick_waiting` hands a waiting request a CHECK
                # every WAIT_TICK_S.
                item = await queue.get()
                if isinstance(item, _Check):
                    # Silence is measured on the engine, not this request: a request
                    # queued behind a long prefill waits as long as steps finish.
                    alive = max(self.state.last_ok, self.detector.moved_at, started)
                    now = self.pauses.look()
                    silent = now - alive - self.pauses.paused_within(alive, now)
                    if silent < self._request_timeout_s:
                        continue
                    self.set_healthy(False)
                    raise BackendUnavailable(
                        f"engine '{self.name}' showed no sign of life for "
                        f"{self._request_timeout_s:g} s"
                    )
                if isinstance(item, BackendError):
                    finished = True  # nothing left to cancel on the engine side
                    raise item
                if isinstance(item, Finished):
                    finished = True
                    yield item
                    return
                yield item
        finally:
            self.state.in_flight -= 1
            self._streams.pop(request_id, None)
            self.detector.done(request_id)
            if not finished and self._connected:
                with contextlib.suppress(BackendUnavailable, ConnectionError):
                    self._send(Cancel(id=request_id))

    async def cancel_all(self) -> None:
        for request_id in list(self._streams):
            with contextlib.suppress(BackendUnavailable, ConnectionError):
                self._send(Cancel(id=request_id))
