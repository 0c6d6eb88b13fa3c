"""Server processes for the benchmarks: `mlxserve` or `mlx_lm.server` on a free
loopback port, ready once a one-token completion succeeds, and the small numbers
the reports share. Used by serve.py, huge_prompts.py and false_hangs.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server subprocess; `ready` when a one-token completion succeeds."""

    def __init__(self, argv: list[str], port: int, model: str, env: dict[str, str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.model = model
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        body = {"model": self.model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args!r} exited; see {self.log.name}")
            try:
                if httpx.post(f"{self.url}/v1/completions", json=body, timeout=30).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.proc.args!r} not ready; see {self.log.name}")

    def backend_line(self) -> str | None:
        """mlxserve's startup line for its engine (model, context, speculative depth)."""
        self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return next((line for line in text.splitlines() if "speculative depth" in line), None)

    def tail(self, lines: int = 20) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def mlxserve(model: str, port: int, extra: tuple[str, ...] = ()) -> Server:
    """`mlxserve serve` on `model`; `extra` adds flags (``--config``, ``--speculative-depth``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXSERVE_")}
    if "MLXSERVE_CACHE_DIR" in os.environ:
        env["MLXSERVE_CACHE_DIR"] = os.environ["MLXSERVE_CACHE_DIR"]
    argv = [sys.executable, "-m", "mlxserve", "serve", "--model", model, "--port", str(port)]
    return Server([*argv, *extra], port, model, env)


def mlx_lm_server(model: str, port: int) -> Server:
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port)]
    argv += ["--log-level", "WARNING"]
    return Server(argv, port, model, dict(os.environ))
