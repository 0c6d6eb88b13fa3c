"""The engine process: one engine behind a unix socket, serving the front process.

    python -m mlxserve.engine --socket PATH [--config F] [--model M]
                              [--policy KEY=VALUE ...]

Settings come from the config file, `MLXSERVE_*` variables and these flags,
as everywhere else. Why a process of its own: a wedged MLX call cannot be
cancelled, only its process ended, and the front must outlive it. So this
process is disposable by design: it builds the plan, loads the model, starts
the engine loop and the progress watchdog, and only then creates the socket
(mode 0600; its directory 0700 when this process makes it), so the socket's
existence means "ready". It serves one front connection at a time: `hello`
first, then the messages of `mlxserve.channel.messages`.

Under a launcher (MLX_RANK set), a rank other than 0 runs the follower instead
(`mlxserve.engine.process.follower`): that is how the front starts a tensor-parallel
group as one backend (`mlxserve.cluster.launch`).

Exit codes: 0 after SIGTERM or SIGINT; 2 for a usage error or a plan that
refuses to start (one line on stderr); 75 when the watchdog saw no progress;
70 when the engine loop itself crashed; 3 for an injected crash (tests).
Log lines on stderr start with `mlxserve-engine[PID]`.
"""

import argparse
import logging
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Final, NoReturn

import mlx.core as mx

from mlxserve.channel.messages import Error, Hello, encode
from mlxserve.cluster.discover import GroupPortTaken
from mlxserve.config import Settings, load_settings
from mlxserve.engine.core.build import LoadedModel
from mlxserve.engine.core.stepper import Engine
from mlxserve.engine.process.front_link import POLL_S, FrontLink
from mlxserve.engine.process.socket_end import FrontDesk
from mlxserve.errors import UsageError
from mlxserve.hardware.cuda_graphs import configure_cuda_graphs

log = logging.getLogger("mlxserve.engine.process.loop")

LOG_PREFIX: Final = "mlxserve-engine"
EXIT_USAGE: Final = 2
EXIT_ENGINE_CRASHED: Final = 70  # EX_SOFTWARE
EXIT_PORT_TAKEN: Final = 69  # EX_UNAVAILABLE: a group's port was taken; a restart retries
DEFAULT_CONTEXT_LENGTH: Final = 4096
# sun_path is 104 bytes on macOS (108 on Linux), including the terminating NUL.
MAX_SOCKET_PATH_BYTES: Final = 103
# How long shutdown waits for the front connection and the engine loop to end.
STOP_TIMEOUT_S: Final = 5.0


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line, not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{LOG_PREFIX}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m mlxserve.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", type=Path, required=True, help="unix socket path to create")
    parser.add_argument("--config", type=Path, help="config file (TOML)")
    parser.add_argument("--model", help="model directory or 'demo' (default: from config)")
    parser.add_argument(
        "--policy",
        action="append",
        metavar="KEY=VALUE",
        help="override a plan decision, e.g. progress_timeout_s=60 (repeatable)",
    )
    return parser


def cli_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line layer of the settings: only what was given."""
    values: dict[str, Any] = {}
    if args.model:
        values["model"] = args.model
    if args.policy:
        values["policy"] = {"overrides": list(args.policy)}
    return values


class _StopRequested(BaseException):
    """SIGTERM or SIGINT arrived while the process was still starting.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` in
    the loading code swallows it.
    """


class _Signals:
    """SIGTERM/SIGINT: during startup they abort it; once serving they ask the loop to stop."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.serving = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.stop.set()
        if not self.serving:
            raise _StopRequested


#: GIL hand-off interval in the engine process. A token crosses three threads here
#: (socket reader, engine loop, forwarder); at Python's default of 5 ms a woken
#: thread may wait that long for a busy one, several times per request.
SWITCH_INTERVAL_S: Final = 0.0005


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    configure_cuda_graphs()  # before any device work (also when started on its own)
    signals = _Signals()
    signals.install()
    try:
        return _run(args, signals)
    except UsageError as exc:
        print(f"{LOG_PREFIX}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except GroupPortTaken as exc:
        print(f"{LOG_PREFIX}: error: {exc}", file=sys.stderr)
        return EXIT_PORT_TAKEN
    except _StopRequested:
        log.info("stopped while starting")
        return 0


def _run(args: argparse.Namespace, signals: _Signals) -> int:
    from mlxserve.cluster.discover import launched_rank
    from mlxserve.engine.process.follower import run_follower
    from mlxserve.reliability.faults import active_faults
    from mlxserve.startup.plan import build_plan

    settings = load_settings(args.config, cli_settings(args))
    rank = launched_rank()
    if rank is not None and rank > 0 and not settings.cluster.simulate:
        # A group the front started (mlxserve.cluster.launch): every rank runs this
        # command; the ranks other than 0 follow rank 0's steps and serve no socket.
        signals.serving = True  # the follower handles its own signals from here
        return run_follower(settings)
    try:
        faults = active_faults()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    plan, membership = build_plan(settings)
    plan.ensure_startable()
    socket_path = prepare_socket_path(args.socket)
    configure_logging()
    log.info("plan %s; progress timeout %g s", plan.plan_hash[:12], plan.progress_timeout_s())
    for warning in plan.warnings:
        log.warning("plan: %s (rule %s)", warning.message, warning.rule)

    from mlxserve.engine.core.build import build_engine
    from mlxserve.engine.process.warmup import WARM_UP_STEP_S
    from mlxserve.reliability.faults import FaultInjector
    from mlxserve.reliability.orphan import watch_parent
    from mlxserve.reliability.watchdog import Watchdog

    engine, loaded = build_engine(settings, plan, membership.rank, membership.group)
    # The peak memory reported with each request is the serving peak, not loading's.
    mx.reset_peak_memory()
    # Watching from the warm-up on: a group that wedges there ends (exit 75) rather
    # than waiting for the front's startup timeout.
    watchdog = Watchdog(engine, plan.progress_timeout_s(), warm_up_timeout_s=WARM_UP_STEP_S)
    watchdog.start()
    _warm_up(settings, engine, loaded)
    if faults.armed:
        log.warning("FAULT INJECTION ARMED (tests only): %s", faults.describe())
        engine.before_step = FaultInjector(faults)
    info = describe_model(settings, loaded)
    hello = Hello(
        model=settings.model,
        pid=os.getpid(),
        context_length=info.context_length,
        eos_token_ids=info.eos_token_ids,
        speculative_depth=engine.depth,
        speculative_auto=engine.auto,
        plan=plan.document(),
    )
    loop = EngineLoop(engine)
    loop.start()
    desk = FrontDesk(engine, hello, info.vocab_size)
    signals.serving = True  # from here a signal lets `serve` return and clean up
    watch_parent(signals.stop.set)
    listener, inode = listen(prepare_socket_path(socket_path))
    log.info(
        "serving %s on %s (context %d, speculative depth %s)",
        settings.model,
        socket_path,
        info.context_length,
        "auto" if engine.auto else engine.depth,
    )
    try:
        serve(listener, desk, signals.stop)
    finally:
        listener.close()
        _remove_socket(socket_path, inode)
    watchdog.stop()
    if not loop.stop(STOP_TIMEOUT_S):
        # A wedged step: the interpreter cannot shut down around it; leave at once.
        log.warning("engine loop did not stop within %g s; exiting anyway", STOP_TIMEOUT_S)
        _flush()
        os._exit(0)
    log.info("stopped")
    return 0


def _warm_up(settings: Settings, engine: Engine, loaded: LoadedModel) -> None:
    """Compile what the first requests would, before the hello (`engine.process.warmup`)."""
    from mlxserve.engine.process.warmup import wanted, warm_up
    from mlxserve.hardware.probe import device_type

    if not wanted(settings.engine.warm_up, device_type()):
        return
    # Under tensor parallelism the followers run the same steps (`lockstep`).
    prompt = tuple(loaded.tokenizer.encode("Warm up: say hello.")) or (0,)
    try:
        seconds = warm_up(engine, prompt)
    except RuntimeError as exc:  # serving shows the same failure on a real request
        log.warning("warm-up failed: %s", exc)
        return
    ranks = f", on all {engine.lockstep.group.size()} ranks" if engine.lockstep else ""
    log.info("warm-up: %.1f s (kernels compiled, depth costs measured%s)", seconds, ranks)


def serve(listener: socket.socket, desk: FrontDesk, stop: threading.Event) -> None:
    """Accept front connections, one at a time, until `stop` is set."""
    active: threading.Thread | None = None
    active_link: FrontLink | None = None
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError as exc:
            log.error("accept failed: %s", exc)
            stop.wait(POLL_S)
            continue
        link = FrontLink(conn)
        if active is not None and active.is_alive():
            active.join(1.0)  # a restarted front may be faster than our EOF on its old link
        if active is not None and active.is_alive():
            log.warning("refusing a second front connection")
            link.send(encode(Error(message="this engine already serves a front connection")))
            link.close()
            continue
        log.info("front connected")
        active, active_link = (
            threading.Thread(target=desk.serve, args=(link,), name="mlxserve-front", daemon=True),
            link,
        )
        active.start()
    log.info("stopping")
    desk.stopping.set()
    if active_link is not None:
        active_link.hang_up()
    if active is not None:
        active.join(STOP_TIMEOUT_S)


class EngineLoop:
    """The engine's loop: `Engine.run_once` on a daemon thread until `stop`.

    A crash of the loop ends the process: a loop that died silently would leave
    every request waiting forever with no step in flight for the watchdog to
    see, so it exits with code 70 and the front restarts it (`exit`: tests
    record the code instead).
    """

    def __init__(self, engine: Engine, exit: Callable[[int], object] = os._exit) -> None:
        self.engine = engine
        self._exit = exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """True when the loop ended within `timeout` seconds."""
        self._stop.set()
        self.engine.wake()  # ends the loop's blocking wait for work
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.engine.run_once(block=True)
            if self.engine.lockstep is not None:
                self.engine.lockstep.stop()  # the follower ranks exit too
            # Decode steps leave the next token computing (async_eval); MLX aborts the
            # process (std::terminate) if it is still in flight when the interpreter exits.
            mx.synchronize()
        except BaseException:
            log.critical(
                "engine loop crashed; exiting with code %d", EXIT_ENGINE_CRASHED, exc_info=True
            )
            _flush()
            self._exit(EXIT_ENGINE_CRASHED)


@dataclass(frozen=True)
class ModelInfo:
    context_length: int
    eos_token_ids: list[int]
    vocab_size: int | None


def describe_model(settings: Settings, loaded: LoadedModel) -> ModelInfo:
    """What the front needs to know about the model, from its config and tokenizer."""
    args = getattr(loaded.model, "args", None)
    context = getattr(args, "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        log.warning(
            "%s: no max_position_embeddings in the model config; assuming a context of %d",
            settings.model,
            DEFAULT_CONTEXT_LENGTH,
        )
        context = DEFAULT_CONTEXT_LENGTH
    vocab = getattr(args, "vocab_size", None)
    eos = getattr(loaded.tokenizer, "eos_token_ids", None) or []
    return ModelInfo(
        context_length=context,
        eos_token_ids=sorted(int(t) for t in eos),
        vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
    )


def prepare_socket_path(path: Path) -> Path:
    """Check `path` can become our socket: parent directory made (0700), stale socket removed.

    Refuses (UsageError) a path that is too long, a non-socket file in the way,
    or a socket another process is listening on.
    """
    path = path.absolute()
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise UsageError(f"{path}: socket path longer than {MAX_SOCKET_PATH_BYTES} bytes")
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o700, parents=True)
        parent.chmod(0o700)  # mkdir's mode is filtered by the umask
    elif not parent.is_dir():
        raise UsageError(f"{parent}: not a directory")
    try:
        info = path.lstat()
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(info.st_mode):
        raise UsageError(f"{path}: exists and is not a socket")
    if _socket_in_use(path):
        raise UsageError(f"{path}: another process is listening on this socket")
    path.unlink()
    return path


def _socket_in_use(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def listen(path: Path) -> tuple[socket.socket, int]:
    """A listening unix socket at `path`, mode 0600 from the moment it exists, and its inode."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        listener.bind(str(path))
    except OSError as exc:
        listener.close()
        raise UsageError(f"{path}: cannot create the socket: {exc.strerror}") from None
    finally:
        os.umask(previous)
    path.chmod(0o600)
    listener.listen(4)
    listener.settimeout(POLL_S)  # accept wakes up to notice a stop request
    return listener, path.lstat().st_ino


def _remove_socket(path: Path, inode: int) -> None:
    """Remove the socket file, unless another process has replaced it since."""
    try:
        if path.lstat().st_ino == inode:
            path.unlink()
    except OSError:
        pass


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s {LOG_PREFIX}[%(process)d] %(levelname)s %(name)s: %(message)s"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()


def run_and_exit() -> None:
    """Run, then leave without interpreter teardown.

    MLX's worker threads can still be winding down at exit, and C++ static
    destruction then aborts the process (SIGABRT) now and then; the process is
    done either way, so its exit code must not depend on that race.
    """
    code = main()
    _flush()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    # One entry point: `python -m mlxserve.engine` hides PyTorch before this module's
    # imports reach transformers; by the time this line runs, they have imported it.
    sys.stderr.write("start the engine with: python -m mlxserve.engine --socket PATH\n")
    sys.exit(2)
