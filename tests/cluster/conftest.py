"""Start real MLX ring ranks on loopback, by hand (MLX_RANK + MLX_HOSTFILE)."""

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

RankRun = subprocess.CompletedProcess[str]
RunRanks = Callable[[list[str], list[dict[str, str]]], list[RankRun]]


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture
def run_ranks(tmp_path: Path) -> RunRanks:
    """Run `python -m mlxserve ARGS` as N ring ranks with per-rank extra environment."""

    def run(args: list[str], rank_envs: list[dict[str, str]], timeout: float = 90) -> list[RankRun]:
        hostfile = tmp_path / "hosts.json"
        ports = _free_ports(len(rank_envs))
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
        procs = []
        for rank, extra in enumerate(rank_envs):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile), **extra}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "mlxserve", *args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        results = []
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=timeout)
                results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        finally:
            for proc in procs:
                proc.kill()
        return results

    return run
