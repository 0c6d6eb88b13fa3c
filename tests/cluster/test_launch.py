"""`python -m mlxserve.cluster.launch`: mlx.launch's machinery, with a clean Ctrl-C.

Two real ring ranks of `mlxserve serve` on loopback. Ctrl-C reaches the whole
process group (launcher and ranks, as from a terminal): rank 0 drains, the
follower waits for its stop, and everything exits 0 with no traceback.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mlxserve.cluster.launch import group_status
from tests.ring import held_ports
from tests.server.live import REPO

CONFIG = """
model = "demo"
[server]
port = 0
ready_interval_s = 2.0
"""


def test_group_status() -> None:
    assert group_status({0: 0, 1: 0}) == 0
    assert group_status({0: None, 1: -9}) == 137  # killed by SIGKILL
    assert group_status({0: 3, 1: 75}) == 75  # a watchdog exit says the most
    assert group_status({0: 1, 1: 2}) == 1


@pytest.fixture
def starting_port() -> Iterator[int]:
    """mlx.launch's ring ranks bind the starting port and the next: both held till the end."""
    with held_ports(2, consecutive=True) as ports:
        yield ports[0]


@pytest.mark.slow
def test_ctrl_c_on_the_process_group_drains_and_exits_0(tmp_path: Path, starting_port: int) -> None:
    config = tmp_path / "config.toml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXSERVE_")}
    env.update(OMP_NUM_THREADS="1", MLXSERVE_SERVER__STATE_DIR=str(tmp_path / "state"))
    command = [sys.executable, "-m", "mlxserve.cluster.launch", "--backend", "ring"]
    command += ["--hosts", "127.0.0.1,127.0.0.1", "--starting-port", str(starting_port)]
    command += ["--", sys.executable, "-m", "mlxserve", "--config", str(config)]
    launcher = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a terminal's job
    )
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(launcher.stdout.readline, "")),  # type: ignore[union-attr]
        daemon=True,
    )
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("ready: http://" in line for line in lines):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        url = next(line for line in lines if "ready: http://" in line).split()[2]
        body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C at the terminal
        code = launcher.wait(timeout=90)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    reader.join(10)
    for pipe in (launcher.stdin, launcher.stdout):
        if pipe is not None:
            pipe.close()
    output = "".join(lines)
    assert code == 0, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert "draining" in output and "rank 0 stopped after" in output, output[-3000:]
