"""`mlx.launch`, for mlxserve: start a tensor-parallel group and end it cleanly.

    python -m mlxserve.cluster.launch [mlx.launch's arguments] -- COMMAND ...

It runs mlx.launch's own machinery (ring or JACCL; mlxserve has no transport
of its own) with two differences that serving needs:

- Signals. A Ctrl-C at the terminal reaches the whole process group, ranks
  included: rank 0 drains and then tells the other ranks to stop. mlx.launch
  itself would die at once with a KeyboardInterrupt traceback (exit 130); this
  launcher waits for its ranks instead, so the group drains and exits 0. The
  same holds for SIGTERM, which the front sends to the whole group when it
  stops one it started. A third signal leaves at once (exit 130).
- Exit status. mlx.launch exits 0 whatever its ranks did; this launcher exits
  0 only when every rank did, 75 when a rank's watchdog fired, else the first
  failing rank's status (128 + N for a rank killed by signal N). The front reads
  it like a single engine's.
"""

import contextlib
import random
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Final

from mlxserve.cluster.signals import SignalCounter

EXIT_WATCHDOG: Final = 75
SIGNALS_BEFORE_EXIT: Final = 3


def group_status(codes: dict[int, int | None]) -> int:
    """The launcher's exit status from its ranks' (None: unknown, e.g. killed by us)."""
    known = [code for _, code in sorted(codes.items()) if code is not None]
    if EXIT_WATCHDOG in known:
        return EXIT_WATCHDOG
    failing = [code for code in known if code != 0]
    if not failing:
        return 0
    code = failing[0]
    return 128 - code if code < 0 else code


#: Where group ports are drawn from: below Linux's ephemeral range (32768-60999),
#: which outgoing connections (HTTP clients, the front's own) take from at any time.
PORT_RANGE: Final = (20000, 32000)


def free_port_run(count: int, attempts: int = 64) -> int:
    """A port p with p .. p + count - 1 free now (ring ranks bind starting port +
    their index), drawn at random from `PORT_RANGE`. Still a race with other
    processes; a rank that loses it exits with a retried code (`GroupPortTaken`)."""
    for _ in range(attempts):
        start = random.randrange(PORT_RANGE[0], PORT_RANGE[1] - count)
        try:
            with contextlib.ExitStack() as held:
                for port in range(start, start + count):
                    probe = held.enter_context(socket.socket())
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return start
    raise RuntimeError(f"no run of {count} free ports found in {attempts} tries")


def launcher_command(
    hosts: Sequence[str], backend: str, env: Mapping[str, str], python: str = sys.executable
) -> list[str]:
    """The command that starts a group on `hosts`; the engine command follows after `--`.

    A fresh starting port each time (a restarted group must not wait for the old
    one's ports), and the MLXSERVE_* settings passed with --env so that ranks on
    other hosts (over ssh) get them too.
    """
    port = free_port_run(len(hosts))
    command = [python, "-m", "mlxserve.cluster.launch", "--backend", backend]
    command += ["--hosts", ",".join(hosts), "--starting-port", str(port)]
    for key, value in sorted(env.items()):
        if key.startswith("MLXSERVE_"):
            command += ["--env", f"{key}={value}"]
    return command


def main(argv: Sequence[str] | None = None) -> int:
    from mlx._distributed_utils import launch as mlx_launch

    launch: Any = mlx_launch  # a private module of mlx: untyped, and patched below
    codes: dict[int, int | None] = {}
    base: Any = launch.RemoteProcess

    class RecordedProcess(base):  # type: ignore[misc]
        """mlx.launch's rank process, remembering how it ended."""

        def __init__(self, rank: int, *args: Any, **kwargs: Any) -> None:
            super().__init__(rank, *args, **kwargs)
            self._rank = rank

        @property
        def exit_status(self) -> tuple[int | None, bool | None]:
            status: tuple[int | None, bool | None] = super().exit_status
            codes[self._rank] = status[0]
            return status

    # The ranks act on their own copies of the signals; this process waits for them.
    SignalCounter(SIGNALS_BEFORE_EXIT, exit_code=128 + signal.SIGINT).install()
    launch.RemoteProcess = RecordedProcess
    sys.argv = ["mlx.launch", *(sys.argv[1:] if argv is None else argv)]
    try:
        launch.main()
    finally:
        launch.RemoteProcess = base
        sys.stdout.flush()
        sys.stderr.flush()
    return group_status(codes)


if __name__ == "__main__":
    sys.exit(main())
