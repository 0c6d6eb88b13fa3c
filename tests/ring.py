"""Start real MLX ring ranks on loopback, by hand (MLX_RANK + MLX_HOSTFILE)."""

import json
import os
import socket
import subprocess
import time
from pathlib import Path

RankRun = subprocess.CompletedProcess[str]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


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
    hostfile = workdir / "hosts.json"
    ports = free_ports(len(rank_envs))
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
    deadline = time.monotonic() + timeout
    procs: list[subprocess.Popen[str]] = []
    results = []
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
