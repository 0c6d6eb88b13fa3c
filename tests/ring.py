"""Start real MLX ring ranks on loopback, by hand (MLX_RANK + MLX_HOSTFILE)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.server.live import REPO, LiveServer

RankRun = subprocess.CompletedProcess[str]
PORT_ATTEMPTS = 50


def _held(port: int) -> socket.socket:
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


@contextmanager
def held_ports(count: int, consecutive: bool = False) -> Iterator[list[int]]:
    """Free loopback ports, held (bound, not listening) until the block ends.

    Why held: a port found free and closed again can be taken by anything on the
    machine (a client's ephemeral port, another test's server) before a rank binds
    it, and the rank dies with errno 98. The kernel hands a held port to nobody,
    while MLX's ring, which binds with SO_REUSEADDR and SO_REUSEPORT, can still
    bind it. ``consecutive``: ports P, P+1, ... (how mlx.launch numbers them from
    ``--starting-port``), found in at most `PORT_ATTEMPTS` tries.
    """
    with ExitStack() as stack:
        for _ in range(PORT_ATTEMPTS):
            first = stack.enter_context(_held(0))
            ports = [first.getsockname()[1]]
            try:
                for index in range(1, count):
                    port = ports[0] + index if consecutive else 0
                    ports.append(stack.enter_context(_held(port)).getsockname()[1])
            except (OSError, OverflowError):
                stack.close()
                continue
            yield ports
            return
        raise RuntimeError(f"no {count} consecutive free ports in {PORT_ATTEMPTS} tries")


def write_hostfile(path: Path, ports: list[int]) -> Path:
    """An MLX ring hostfile: one rank per loopback port."""
    path.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
    return path


@contextmanager
def served_by_two_ranks(
    workdir: Path, config: str, follower_env: dict[str, str] | None = None
) -> Iterator[tuple[LiveServer, "subprocess.Popen[str]"]]:
    """`mlxserve serve` on two ring ranks: rank 0 (a started `LiveServer`) serves HTTP,
    rank 1 follows (its stderr piped, `follower_env` added to its environment).

    Started the way `mlx.launch` starts them: the same command and config per rank,
    MLX_RANK and MLX_HOSTFILE set, on loopback. Both are ended on the way out.
    """
    with held_ports(2) as ports:
        hostfile = write_hostfile(workdir / "hosts.json", ports)
        cluster = {"MLX_HOSTFILE": str(hostfile), "OMP_NUM_THREADS": "1"}
        front = LiveServer(workdir, config, env={**cluster, "MLX_RANK": "0"})
        follower = subprocess.Popen(
            [sys.executable, "-m", "mlxserve", "--config", str(front.config)],
            cwd=REPO,
            env={**front.env, **cluster, "MLX_RANK": "1", **(follower_env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            front.start(timeout=180)
            yield front, follower
        finally:
            front.stop(signal.SIGTERM, timeout=30)
            if follower.poll() is None:
                follower.kill()
                follower.communicate()
            elif follower.stderr is not None and not follower.stderr.closed:
                follower.stderr.close()


def run_ring_ranks(
    command: list[str],
    rank_envs: list[dict[str, str]],
    workdir: Path,
    timeout: float = 90,
    cwd: Path | None = None,
) -> list[RankRun]:
    """Run ``command`` once per rank, each with its extra environment; wait for all.

    Ring collectives have no timeout, so every rank is killed once ``timeout``
    seconds have passed in all (``communicate`` raises ``TimeoutExpired``) rather
    than left to hang.
    """
    deadline = time.monotonic() + timeout
    procs: list[subprocess.Popen[str]] = []
    results = []
    with held_ports(len(rank_envs)) as ports:
        hostfile = write_hostfile(workdir / "hosts.json", ports)
        try:
            for rank, extra in enumerate(rank_envs):
                env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), **extra}
                procs.append(
                    subprocess.Popen(
                        command,
                        env=env,
                        cwd=cwd,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                )
            for proc in procs:
                remaining = max(deadline - time.monotonic(), 0.1)
                out, err = proc.communicate(timeout=remaining)
                results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        finally:
            for proc in procs:
                proc.kill()
    return results
