"""`mlxserve serve` (also `mlxserve --config F`): the HTTP front and its engines.

Under `mlx.launch` only rank 0 serves HTTP; every other rank runs a follower that
executes rank 0's steps on its shard of the model (`mlxserve.engine.process.follower`).

Startup prints what it does (tokenizer, engines, the policy plan, the URL once
a backend really generates). SIGTERM or Ctrl-C drains: new requests get 503
with Retry-After, in-flight ones may finish within `server.drain_timeout_s`
and are cancelled after it, the engines stop, and the process exits 0. A
second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn

from mlxserve.config import Settings
from mlxserve.errors import UsageError

if TYPE_CHECKING:
    from mlxserve.server.runtime import Runtime

log = logging.getLogger(__name__)

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
HTTP_GRACE_S = 5


def run_serve(settings: Settings) -> int:
    from mlxserve.cluster.discover import launched_rank
    from mlxserve.server.progress import Console
    from mlxserve.server.runtime import Runtime, build_backends
    from mlxserve.server.tokenizer import FrontTokenizer, model_directory

    rank = launched_rank()
    if rank is not None and rank > 0 and not settings.cluster.simulate:
        # Tensor parallelism: rank 0 serves the clients, this rank runs its shard.
        from mlxserve.engine.process.follower import run_follower

        return run_follower(settings)

    check_engines(settings)
    configure_logging()
    console = Console()
    began = time.monotonic()
    from mlxserve.models.loader import preflight

    preflight(settings.model)  # a model the engines would refuse stops us here
    console.say(f"loading the tokenizer of model '{settings.model}'")
    try:
        tokenizer = FrontTokenizer.load(model_directory(settings.model))
    except KeyboardInterrupt:
        return 0
    listener = bind(settings.server.host, settings.server.port)
    host, port = listener.getsockname()[:2]
    runtime = Runtime(settings, tokenizer, build_backends(settings, tokenizer), console)
    runtime.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    names = ", ".join(f"'{b.name}' ({b.kind})" for b in runtime.backends)
    console.say(f"listening on {runtime.url}; starting backends {names}")
    console.say(f"startup so far {time.monotonic() - began:.1f} s; waiting for a healthy backend")
    return asyncio.run(serve(runtime, listener))


def check_engines(settings: Settings) -> None:
    """Every local engine's plan inputs, checked before anything starts (UsageError: exit 2)."""
    from mlxserve.startup.plan import check_plan

    check_plan(settings)
    for index, entry in enumerate(settings.fallback, start=1):
        if entry.model is None:
            continue
        policy = settings.policy.model_copy(update={"overrides": entry.policy})
        # [cluster] split is the primary group's; a fallback's plan chooses its own.
        cluster = settings.cluster.model_copy(update={"hosts": entry.hosts, "split": None})
        try:
            check_plan(settings.model_copy(update={"policy": policy, "cluster": cluster}))
        except UsageError as exc:
            raise UsageError(f"fallback '{entry.name or f'fallback{index}'}': {exc}") from None


def configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def bind(host: str, port: int) -> socket.socket:
    """Bind before starting engines, so a busy port is a one-line error, not a late crash."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, reuse_port=False)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def http_config(runtime: Runtime) -> uvicorn.Config:
    """uvicorn's settings for the front: the app, and connections with Nagle off, arrival
    deadlines and a cap (`mlxserve.server.connections`)."""
    from mlxserve.server.app import create_app
    from mlxserve.server.connections import ConnectionLimits, FrontH11Protocol

    limits = ConnectionLimits.of(runtime.settings.server)
    return uvicorn.Config(
        create_app(runtime),
        http=FrontH11Protocol.with_limits(limits),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=HTTP_GRACE_S,
        timeout_keep_alive=5,
    )


async def serve(runtime: Runtime, listener: socket.socket) -> int:
    server = _Server(http_config(runtime))
    with server.signal_handlers():
        await runtime.start()
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        signalled = asyncio.create_task(server.signalled.wait())
        refused = asyncio.create_task(runtime.supervisor.all_refused.wait())
        await asyncio.wait({serving, signalled, refused}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done():  # the HTTP server failed by itself
            signalled.cancel()
            refused.cancel()
            await runtime.stop()
            serving.result()
            return 1
        if refused.done():  # every engine exited 2: bad settings, nothing to serve with
            signalled.cancel()
            await runtime.stop()
            server.should_exit = True
            await serving
            reasons = "; ".join(f"{n}: {r}" for n, r in runtime.supervisor.refused.items())
            raise UsageError(f"no backend can start ({reasons})")
        refused.cancel()
        settings = runtime.settings.server
        runtime.console.say(
            f"draining: {runtime.admission.in_flight} request(s) in flight, "
            f"up to {settings.drain_timeout_s:g} s (signal again to stop now)"
        )
        server.signalled.clear()
        drain = asyncio.create_task(runtime.drain(settings.drain_timeout_s))
        again = asyncio.create_task(server.signalled.wait())
        await asyncio.wait({drain, again}, return_when=asyncio.FIRST_COMPLETED)
        if not drain.done():
            drain.cancel()
            runtime.router.closed = True
            await runtime.router.cancel_all()
        again.cancel()
        runtime.console.say("stopping engines")
        await runtime.stop()
        server.should_exit = True
        await serving
    runtime.console.say("stopped")
    return 0


class _Server(uvicorn.Server):
    """uvicorn's Server with our signal handling: drain first, then exit 0.

    uvicorn's own handlers stop accepting connections at once (no 503 while
    draining) and re-raise the signal after shutdown (no exit 0).
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.signalled = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # `signal_handlers` below is in charge

    @contextlib.contextmanager
    def signal_handlers(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in SHUTDOWN_SIGNALS:
            loop.add_signal_handler(sig, self.signalled.set)
        try:
            yield
        finally:
            for sig in SHUTDOWN_SIGNALS:
                loop.remove_signal_handler(sig)
