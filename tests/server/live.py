"""A real `mlxserve` server in a subprocess, on a free loopback port, for end-to-end tests."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
#: The model the end-to-end tests serve: the demo unless a test run says otherwise.
MODEL = os.environ.get("MLXSERVE_TEST_MODEL", "demo")
START_TIMEOUT_S = 300.0


class LiveServer:
    def __init__(self, workdir: Path, config: str, env: dict[str, str] | None = None) -> None:
        self.config = workdir / "config.toml"
        self.config.write_text(config)
        self.log_path = workdir / "server.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("MLXSERVE_")}
        self.env["MLXSERVE_CACHE_DIR"] = os.environ.get(
            "MLXSERVE_CACHE_DIR", str(Path.home() / ".cache" / "mlxserve")
        )
        if "state_dir" not in config:  # incidents of a test never reach the user's memory
            self.env["MLXSERVE_SERVER__STATE_DIR"] = str(workdir / "state")
        self.env.update(env or {})
        self.lines: list[str] = []
        self.url = ""
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread

    def start(self, timeout: float = START_TIMEOUT_S, active: str = "primary") -> "LiveServer":
        """Start, and wait until `active` (by default the primary) serves."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxserve", "--config", str(self.config)],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self.url:
            self._check_alive(deadline)
            for line in list(self.lines):
                if "listening on http://" in line:
                    self.url = line.split("listening on ")[1].split(";")[0].strip()
            time.sleep(0.1)
        self.wait_ready(deadline - time.monotonic(), active=active)
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        with self.log_path.open("w") as log:
            for line in self.proc.stderr:
                self.lines.append(line.rstrip())
                log.write(line)
                log.flush()

    def _check_alive(self, deadline: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not ready in time:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def ready(self) -> tuple[int, dict[str, Any]]:
        response = httpx.get(f"{self.url}/ready", timeout=10)
        return response.status_code, response.json()

    def incidents(self, count: int = 1, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The incidents, once `count` are recorded: the front reaps an engine a moment
        after its channel closes, so the record can follow the failover or a peer's exit."""
        deadline = time.monotonic() + timeout_s
        while True:
            _, detail = self.ready()
            found: list[dict[str, Any]] = detail["incidents"]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def settled(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """/ready once no backend has a request in flight: a backend's count drops when
        its stream is closed, which can be an event-loop turn after the admission slot
        (`mlxserve_running_requests`) is released."""
        deadline = time.monotonic() + timeout_s
        while True:
            _, detail = self.ready()
            idle = all(b["in_flight"] == 0 for b in detail["backends"])
            if idle or time.monotonic() > deadline:
                return detail
            time.sleep(0.1)

    def logged(self, text: str, timeout_s: float = 15.0) -> str:
        """The first line of the server's output containing `text`, once read: the line
        is written before what the test saw (an answer, a record), but this process's
        reader thread takes it from the pipe a moment later."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = next((line for line in list(self.lines) if text in line), None)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not logged in {timeout_s} s:\n{self.tail()}")
            time.sleep(0.05)

    def wait_ready(self, timeout: float, active: str | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive(deadline)
            status, detail = self.ready()
            if status == 200 and (active is None or detail["active"] == active):
                return detail
            time.sleep(0.2)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code
