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
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path

from pydantic import ValidationError

from mlxserve.channel.messages import (
    Cancel,
    Error,
    Finish,
    Generate,
    Hello,
    Status,
    StatusRequest,
    decode_engine,
    encode,
)
from mlxserve.channel.messages import Tokens as Tokens_
from mlxserve.engine.request import TokenLogprob
from mlxserve.server.backends.base import (
    Backend,
    BackendEvent,
    BackendInfo,
    BackendRefused,
    BackendRequestFailed,
    BackendUnavailable,
    Finished,
    GenerationParams,
    Tokens,
)

log = logging.getLogger(__name__)

FAULT_PREFIX = "MLXSERVE_FAULT_"
LINE_LIMIT = 64 << 20  # a Generate line carries the whole prompt
STOP_GRACE_S = 5.0
OUTPUT_TAIL_LINES = 80
OUTPUT_GRACE_S = 2.0
EXIT_USAGE = 2  # the engine's "bad settings" exit: restarting it cannot help

_Item = BackendEvent | BackendUnavailable


class LocalEngine(Backend):
    kind = "local"

    def __init__(
        self,
        name: str,
        *,
        env: Mapping[str, str],
        startup_timeout_s: float,
        request_timeout_s: float,
        python: str = sys.executable,
    ) -> None:
        super().__init__(name)
        self._env = dict(env)
        self._startup_timeout_s = startup_timeout_s
        self._request_timeout_s = request_timeout_s
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
        self.output_tail.clear()
        self._dir = Path(tempfile.mkdtemp(prefix="mlxserve-engine-"))  # mode 0700
        socket_path = self._dir / "engine.sock"
        self._proc = await asyncio.create_subprocess_exec(
            self._python,
            "-m",
            "mlxserve.engine.process",
            "--socket",
            str(socket_path),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.child_env(),
            start_new_session=True,
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
        return hello

    async def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
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
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

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
            if queue is not None:
                self.proof_of_life()
                logprobs = None
                if message.logprobs is not None:
                    logprobs = tuple(
                        TokenLogprob(r.token, r.logprob, tuple(r.top)) for r in message.logprobs
                    )
                queue.put_nowait(Tokens(tuple(message.token_ids), logprobs))
        elif isinstance(message, Finish):
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
                )
            )
        elif isinstance(message, Status):
            if self._status_waiters:
                waiter = self._status_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(message)
        elif isinstance(message, Error):
            log.warning("engine '%s' reported: %s", self.name, message.message)
            queue = self._streams.get(message.id) if message.id else None
            if queue is not None:
                queue.put_nowait(BackendRequestFailed(f"engine '{self.name}': {message.message}"))

    def _lost(self, reason: str) -> None:
        if self._connected:
            level = logging.INFO if self._stopping else logging.WARNING
            log.log(level, "engine '%s' is gone: %s", self.name, reason)
        self._connected = False
        self.set_healthy(False)
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
        self._streams[request_id] = queue
        finished = False
        self.state.in_flight += 1
        try:
            self._send(
                Generate(
                    id=request_id,
                    prompt_ids=list(params.prompt_ids),
                    max_tokens=params.max_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    seed=params.seed,
                    stop_token_ids=list(params.stop_token_ids),
                    speculative_depth=None,
                    top_k=params.top_k,
                    min_p=params.min_p,
                    presence_penalty=params.presence_penalty,
                    frequency_penalty=params.frequency_penalty,
                    repetition_penalty=params.repetition_penalty,
                    logit_bias=list(params.logit_bias),
                    logprobs=params.logprobs,
                    grammar=params.grammar,
                    grammar_prefix=list(params.grammar_prefix),
                )
            )
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), self._request_timeout_s)
                except TimeoutError:
                    self.set_healthy(False)
                    raise BackendUnavailable(
                        f"engine '{self.name}' sent nothing for {self._request_timeout_s:g} s"
                    ) from None
                if isinstance(item, BackendUnavailable):
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
            if not finished and self._connected:
                with contextlib.suppress(BackendUnavailable, ConnectionError):
                    self._send(Cancel(id=request_id))

    async def cancel_all(self) -> None:
        for request_id in list(self._streams):
            with contextlib.suppress(BackendUnavailable, ConnectionError):
                self._send(Cancel(id=request_id))
