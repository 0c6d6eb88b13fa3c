"""Concurrency on the live server: streams progress together; a long prefill does not freeze them.

The engine interleaves prefill chunks (engine.prefill_step = 64 in the live
config) with decode steps, so a stream that is decoding keeps receiving tokens
while another request's long prompt is prefilled. The bounds are explicit and
generous (shared 2-core CI machines): they catch a scheduler that runs a whole
prefill in one go, not small slowdowns.
"""

import itertools
import json
import threading
import time

import httpx
import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow


def stream_times(
    url: str, body: dict[str, object], out: list[float], stop: threading.Event | None = None
) -> None:
    """Arrival times of the text chunks; returns early (disconnects) once `stop` is set."""
    with (
        httpx.Client(timeout=300) as client,
        client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    out.append(time.monotonic())
            if stop is not None and stop.is_set():
                return


def body(prompt: str | list[int], max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_two_streams_both_progress(live: LiveServer) -> None:
    a: list[float] = []
    b: list[float] = []
    threads = [
        threading.Thread(target=stream_times, args=(live.url, body("The for statement", 120), a)),
        threading.Thread(target=stream_times, args=(live.url, body("The while loop", 120), b)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(a) > 10 and len(b) > 10
    # Interleaved, not one after the other: each got tokens before the other finished.
    assert a[0] < b[-1] and b[0] < a[-1]
    overlap = min(a[-1], b[-1]) - max(a[0], b[0])
    assert overlap > 0.5 * min(a[-1] - a[0], b[-1] - b[0])


def test_long_prefill_does_not_freeze_other_streams(live: LiveServer) -> None:
    decoding: list[float] = []
    done = threading.Event()
    runner = threading.Thread(
        target=stream_times, args=(live.url, body("The for statement", 2000), decoding, done)
    )
    runner.start()
    deadline = time.monotonic() + 60
    while len(decoding) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    long_prompt = [100 + (i * 7) % 800 for i in range(1800)]  # ~28 prefill chunks of 64
    started = time.monotonic()
    first: list[float] = []
    stream_times(live.url, body(long_prompt, 1), first)
    prefill_s = first[0] - started
    done.set()
    runner.join(60)
    during = [t for t in decoding if started <= t <= first[0]]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    # The decoding stream kept receiving tokens throughout the other request's prefill...
    assert len(during) >= 5, (len(during), prefill_s)
    # ...with no pause longer than half of that prefill, and never more than 5 s.
    longest = max(gaps, default=prefill_s)
    assert longest < max(0.5 * prefill_s, 0.25), (longest, prefill_s)
    assert longest < 5.0
