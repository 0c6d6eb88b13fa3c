"""Failover with real engine processes: a hang, a crash and a `kill -9` of the primary.

Each scenario: a primary and a local fallback engine on the same model; the
primary alone carries the fault (its environment) and a 2 s progress timeout
(its policy). Four concurrent greedy streams must each end with exactly the
text an undisturbed run gives, /metrics must count one failover, and the
primary must come back and serve the next request.
"""

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

PROGRESS_TIMEOUT_S = 2.0
HANG_FLOOR_S = 3.0  # the front's default
FAULT_STEP = 20
MAX_TOKENS = 48
PROMPTS = [
    "Python reference: for",
    "Python reference: while",
    "Python reference: import",
    "Python reference: lambda",
]


def config(fault: str | None) -> str:
    fault_env = f'engine_env = {{ MLXSERVE_FAULT_{fault} = "{FAULT_STEP}" }}' if fault else ""
    return f"""
model = "{MODEL}"
[policy]
overrides = ["progress_timeout_s={PROGRESS_TIMEOUT_S}"]
[server]
port = 0
ready_interval_s = 30.0
retry_attempts = 8
retry_backoff_s = 0.2
retry_backoff_max_s = 2.0
restart_backoff_s = 0.2
{fault_env}
[[fallback]]
name = "standby"
model = "{MODEL}"
"""


@dataclass
class Stream:
    prompt: str
    chunks: list[tuple[float, str]] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    backend: str | None = None

    @property
    def text(self) -> str:
        return "".join(piece for _, piece in self.chunks)


def run_stream(url: str, stream: Stream) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": stream.prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    try:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
        ):
            stream.backend = response.headers.get("x-mlxserve-backend")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    stream.error = chunk["error"]["message"]
                    continue
                choice = chunk["choices"][0]
                stream.chunks.append((time.time(), choice["delta"].get("content") or ""))
                stream.finish = choice.get("finish_reason") or stream.finish
    except Exception as exc:
        stream.error = repr(exc)


def run_all(url: str, on_started: "callable[[list[Stream]], None] | None" = None) -> list[Stream]:  # type: ignore[valid-type]
    streams = [Stream(prompt) for prompt in PROMPTS]
    threads = [threading.Thread(target=run_stream, args=(url, s)) for s in streams]
    for thread in threads:
        thread.start()
    if on_started is not None:
        on_started(streams)
    for thread in threads:
        thread.join(180)
    return streams


def primary_pid(server: LiveServer) -> int:
    _, detail = server.ready()
    pid = detail["backends"][0]["pid"]
    assert isinstance(pid, int)
    return pid


def check_recovery(server: LiveServer, disturbed: list[Stream]) -> list[Stream]:
    """The primary comes back, serves the next requests, and they equal the disturbed ones."""
    server.wait_ready(180, active="primary")
    reference = run_all(server.url)
    for stream in reference:
        assert stream.error is None, stream.error
        assert stream.backend == "primary"
    for got, want in zip(disturbed, reference, strict=True):
        assert got.error is None, got.error
        assert got.text == want.text, (got.prompt, got.text, want.text)
        assert got.finish == want.finish
    return reference


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path, config(request.param))
    try:
        yield live.start()
    finally:
        code = live.stop()
        assert code == 0, live.tail()


@pytest.mark.parametrize("server", ["HANG_AT_STEP"], indirect=True)
def test_hang_watchdog_exit_and_resume(server: LiveServer) -> None:
    streams = run_all(server.url)
    found = server.incidents(1)
    assert [(i["backend"], i["kind"]) for i in found] == [("primary", "watchdog")], server.tail()
    assert found[0]["exit_code"] == 75
    exited = found[0]["at"]
    assert isinstance(exited, float)
    # The hang starts right after the last token the primary delivered.
    last_before = max(t for s in streams for t, _ in s.chunks if t < exited)
    assert exited - last_before <= PROGRESS_TIMEOUT_S + 2.0, exited - last_before
    assert any(t > exited for s in streams for t, _ in s.chunks), "no stream was resumed"
    assert server.metric("mlxserve_failovers_total") == 1
    assert server.metric("mlxserve_incidents_total", kind="watchdog") == 1
    server.logged("incident: backend 'primary' watchdog")
    check_recovery(server, streams)


@pytest.mark.parametrize("server", ["CRASH_AT_STEP"], indirect=True)
def test_crash_then_kill_9(server: LiveServer) -> None:
    streams = run_all(server.url)
    assert [i["kind"] for i in server.incidents(1)] == ["crash"], server.tail()
    assert server.metric("mlxserve_failovers_total") == 1
    check_recovery(server, streams)

    # The restarted primary runs without the fault; now kill it mid-stream.
    def kill_when_streaming(streams: list[Stream]) -> None:
        deadline = time.monotonic() + 60
        while not all(s.chunks for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(primary_pid(server), signal.SIGKILL)

    killed = run_all(server.url, kill_when_streaming)
    assert [i["kind"] for i in server.incidents(2)] == ["crash", "killed"]
    assert server.metric("mlxserve_failovers_total") == 2
    assert server.metric("mlxserve_request_retries_total", backend="primary") >= 1
    check_recovery(server, killed)


@pytest.mark.parametrize("server", [None], indirect=True)
def test_sigstop_is_declared_hung_by_the_front_within_seconds(server: LiveServer) -> None:
    """A frozen primary (SIGSTOP: not even its watchdog runs) is left within hang_floor_s.

    The stall any stream sees must stay under the front's hang floor (3 s by default)
    plus the retry's backoff, not the engine watchdog's timeout.
    """
    stopped: list[int] = []

    def stop_when_streaming(streams: list[Stream]) -> None:
        deadline = time.monotonic() + 60
        while not all(len(s.chunks) >= 3 for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = primary_pid(server)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    streams = run_all(server.url, stop_when_streaming)
    assert stopped, "the streams never started"
    found = server.incidents(1)
    assert [(i["backend"], i["kind"]) for i in found] == [("primary", "hung")], server.tail()
    assert server.metric("mlxserve_failovers_total") == 1
    stall = max(
        later - earlier
        for s in streams
        for (earlier, _), (later, _) in zip(s.chunks, s.chunks[1:], strict=False)
    )
    print(f"longest stall {stall:.2f} s")
    # The engine watchdog would take 30 s; 4 s of slack over the floor covers the
    # retry's backoff, the fallback's prefill and a loaded 2-core machine (5.05 s seen).
    assert stall <= HANG_FLOOR_S + 4.0, stall
    server.logged("engine 'primary' is hung")
    check_recovery(server, streams)


def test_long_prefill_with_probes_and_streams_is_not_declared_hung(tmp_path: Path) -> None:
    """A 3,000-token prompt, while 4 streams decode and probes run, is no hang.

    The hang floor is set low (1 s), below what a late 512-token prefill chunk
    takes on a CPU: only the front's use of measured step times (20 x p99 per
    prompt token) keeps it from being declared hung.
    """
    text = config(None).replace("[server]\n", "[server]\nhang_floor_s = 1.0\n")
    # The engine's own watchdog keeps its default (30 s): the front's check is under test.
    text = text.replace(f'overrides = ["progress_timeout_s={PROGRESS_TIMEOUT_S}"]', "")
    text = text.replace("ready_interval_s = 30.0", "ready_interval_s = 0.5")
    live = LiveServer(tmp_path, text).start()
    try:
        answers: list[httpx.Response] = []

        def long_request(streams: list[Stream]) -> None:
            with httpx.Client(timeout=120) as client:
                words = " ".join(f"w{i % 97}" for i in range(1060))
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": words}],
                    "max_tokens": 4,
                    "temperature": 0,
                }
                answers.append(client.post(f"{live.url}/v1/chat/completions", json=body))

        streams = run_all(live.url, long_request)
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["prompt_tokens"] >= 3000
            assert answer.headers["x-mlxserve-backend"] == "primary"
        for stream in streams:
            assert stream.error is None and stream.backend == "primary", stream
        _, detail = live.ready()
        assert detail["incidents"] == [], live.tail()
        assert live.metric("mlxserve_failovers_total") == 0
        assert not any("is hung" in line for line in live.lines), live.tail()
    finally:
        assert live.stop() == 0, live.tail()


@pytest.mark.parametrize("server", [None], indirect=True)
def test_both_backends_killed_lose_nothing(server: LiveServer) -> None:
    """Primary and standby killed 0.5 s apart mid-stream: every backend is down for
    the seconds a restart takes, longer than the retry's backoff. Admitted requests
    wait for one to come back (`restart_wait_s`) and resume exactly: 4/4 answered."""
    killed: list[str] = []

    def kill_both_when_streaming(streams: list[Stream]) -> None:
        deadline = time.monotonic() + 60
        while not all(s.chunks for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        _, detail = server.ready()
        pids = {b["name"]: b["pid"] for b in detail["backends"]}
        os.kill(pids["primary"], signal.SIGKILL)
        killed.append("primary")
        time.sleep(0.5)
        os.kill(pids["standby"], signal.SIGKILL)
        killed.append("standby")

    streams = run_all(server.url, kill_both_when_streaming)
    assert killed == ["primary", "standby"]
    assert sorted(i["backend"] for i in server.incidents(2)) == ["primary", "standby"]
    assert all(s.error is None and s.finish is not None for s in streams), streams
    check_recovery(server, streams)
