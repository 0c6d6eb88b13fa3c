"""A prompt of megabytes stalls nobody: the real server, a stream and /health beside it.

Tokenizing 3.9 MB takes the demo's tokenizer about 5 s. On the event loop that
froze every stream and /health for as long before the context check refused the
prompt; now the prompt is refused from its size (it cannot fit 4096 tokens)
before it is tokenized, and what preparation there is runs off the loop.
"""

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

HUGE_BYTES = 3_900_000
CONFIG = f"""
model = "{MODEL}"
[server]
port = 0
max_body_bytes = {HUGE_BYTES + 100_000}
"""
HEALTH_P100_S = 1.0
STREAM_GAP_S = 2.0
REFUSED_WITHIN_S = 3.0
WINDOW_S = 30.0  # every loop below ends by then
#: Chunks the stream sends before the huge prompts: its first steps include the
#: engine's one-time warm-up (about 1 s), which is not what is measured.
WARM_CHUNKS = 20


def huge_text() -> str:
    line = "Python reference: the for statement iterates over the items of any sequence. "
    return (line * (HUGE_BYTES // len(line) + 1))[:HUGE_BYTES]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = LiveServer(tmp_path_factory.mktemp("huge"), CONFIG).start()
    try:
        yield live
    finally:
        assert live.stop() == 0, live.tail()


class Watch:
    """/health latencies and one stream's chunk times, taken until `done` is set;
    entered once the stream is warm (`WARM_CHUNKS`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done = threading.Event()
        self.streaming = threading.Event()
        self.health: list[float] = []
        self.chunks: list[float] = []
        self.threads = [
            threading.Thread(target=self._poll, daemon=True),
            threading.Thread(target=self._stream, daemon=True),
        ]

    def __enter__(self) -> "Watch":
        for thread in self.threads:
            thread.start()
        assert self.streaming.wait(WINDOW_S), "the stream never started"
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(WINDOW_S)

    def _poll(self) -> None:
        deadline = time.monotonic() + WINDOW_S
        with httpx.Client(base_url=self.url, timeout=WINDOW_S) as client:
            while not self.done.is_set() and time.monotonic() < deadline:
                began = time.monotonic()
                assert client.get("/health").status_code == 200
                self.health.append(time.monotonic() - began)
                time.sleep(0.02)

    def _stream(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Python reference: the for statement"}],
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        deadline = time.monotonic() + WINDOW_S
        with (
            httpx.Client(base_url=self.url, timeout=WINDOW_S) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(time.monotonic())
                    if len(self.chunks) >= WARM_CHUNKS:
                        self.streaming.set()
                if self.done.is_set() or time.monotonic() > deadline:
                    return

    def max_gap(self) -> float:
        """The longest gap between chunks once the stream was warm."""
        warm = self.chunks[WARM_CHUNKS - 1 :]
        return max((b - a for a, b in itertools.pairwise(warm)), default=0.0)


def test_huge_prompts_are_refused_from_their_size_and_stall_nobody(server: LiveServer) -> None:
    text = huge_text()
    requests: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
        ("/v1/completions", {"prompt": text}, "prompt"),
    ]
    with Watch(server.url) as watch, httpx.Client(base_url=server.url, timeout=60) as client:
        time.sleep(0.3)  # a few gaps of the stream alone
        for path, body, param in requests:
            began = time.monotonic()
            response = client.post(path, json={"model": MODEL, **body})
            took = time.monotonic() - began
            assert response.status_code == 400, response.text[:300]
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("context_length_exceeded", param)
            assert took <= REFUSED_WITHIN_S, f"{path}: refused after {took:.2f} s"
        time.sleep(0.3)
    assert watch.health, "no /health answer was timed"
    assert max(watch.health) <= HEALTH_P100_S, f"/health took {max(watch.health):.2f} s"
    assert len(watch.chunks) > WARM_CHUNKS + 10, "the stream did not run beside the prompts"
    assert watch.max_gap() <= STREAM_GAP_S, f"the stream stalled {watch.max_gap():.2f} s"
    _, detail = server.ready()
    assert detail["incidents"] == [], "a huge prompt was taken for a hang"
