"""SIGTERM drains: a request in flight finishes, new ones get 503 + Retry-After, exit 0."""

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

CONFIG = f"""
model = "{MODEL}"
[server]
port = 0
drain_timeout_s = 60.0
"""


def test_sigterm_with_a_request_in_flight(tmp_path: Path) -> None:
    server = LiveServer(tmp_path, CONFIG).start()
    chunks: list[str] = []
    finish: list[str] = []
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Python reference: for"}],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    def stream() -> None:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{server.url}/v1/chat/completions", json=request) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    chunks.append(choice["delta"].get("content") or "")
                    if choice.get("finish_reason"):
                        finish.append(choice["finish_reason"])

    try:
        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 60
        while len(chunks) < 3:
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.005)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not any("draining" in line for line in server.lines):
            assert time.monotonic() < deadline, server.tail()
            time.sleep(0.01)
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"].isdigit()
        assert refused.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 503
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        thread.join(120)
        assert finish == ["length"], server.tail()  # the in-flight request ran to its end
    finally:
        code = server.stop(timeout=90)
    assert code == 0, server.tail()
    assert "mlxserve: stopped" in server.lines
