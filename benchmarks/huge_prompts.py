"""Huge prompts beside streams: does the front keep serving while they arrive?

    python benchmarks/huge_prompts.py [--count 32] [--streams 4] [--bytes 3900000]
                                      [--out huge_prompts.json]

It starts `mlxserve serve` on the demo (default settings: a 3.9 MB prompt is inside
the 4 MiB body limit), opens `--streams` greedy streams and, once they are warm,
sends `--count` prompts of `--bytes` bytes of text at once, spread over the chat,
completions, Responses and Messages routes. Meanwhile it polls ``/health`` every
20 ms and samples the front's resident memory.

It prints one JSON document: ``/health`` latency (p50, p99, p100), the longest gap
between the streams' chunks while the prompts arrived, the front's RSS before,
at its peak and after, how each huge prompt was answered (status and code) and
how long that took, and the incidents the server recorded (a stalled front used
to be taken for a hung engine). ``targets`` checks issue 27's: ``/health`` p100 <=
1 s, stream gaps <= 2 s, every huge prompt a 4xx, no incident.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
from servers import Server, free_port, mlxserve, percentile
from soak import rss_mb

from mlxserve.hardware.probe import benchmark_device_apart

MODEL = "demo"
LINE = "Python reference: the for statement iterates over the items of any sequence. "
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
#: Chunks each stream sends before the huge prompts (the engine's first steps
#: include its one-time warm-up); its gaps are measured from then on.
WARM_CHUNKS = 20
HEALTH_EVERY_S = 0.02
RSS_EVERY_S = 0.1
#: Every wait of the run ends by then.
LIMIT_S = 600.0


def huge_body(route: str, text: str) -> bytes:
    """The route's request around `text`, encoded once (the client's time is not measured)."""
    if route == "/v1/completions":
        body: dict[str, Any] = {"prompt": text}
    elif route == "/v1/responses":
        body = {"input": text}
    else:
        body = {"messages": [{"role": "user", "content": text}]}
        if route == "/v1/messages":
            body["max_tokens"] = 16
    return json.dumps({"model": MODEL, **body}).encode()


class Probe(threading.Thread):
    """/health latencies and the front's RSS, until `stop` is set."""

    def __init__(self, server: Server, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stop = stop
        self.health: list[float] = []
        self.failures: list[str] = []
        self.rss: list[float] = []

    def run(self) -> None:
        deadline = time.monotonic() + LIMIT_S
        sampled = 0.0
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            while not self.stop.is_set() and time.monotonic() < deadline:
                began = time.monotonic()
                try:
                    status = client.get("/health").status_code
                    if status != 200:
                        self.failures.append(str(status))
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.health.append(time.monotonic() - began)
                if began - sampled >= RSS_EVERY_S:
                    sampled = began
                    rss = rss_mb(self.server.proc.pid)
                    if rss is not None:
                        self.rss.append(rss)
                time.sleep(HEALTH_EVERY_S)


class Stream(threading.Thread):
    """One long greedy stream; its chunk times, until `stop` is set."""

    def __init__(self, url: str, index: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.index = index
        self.stop = stop
        self.chunks: list[float] = []
        self.warm = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Python reference {self.index}: lambda"}],
            "max_tokens": 3500,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        deadline = time.monotonic() + LIMIT_S
        try:
            with (
                httpx.Client(base_url=self.url, timeout=LIMIT_S) as client,
                client.stream("POST", "/v1/chat/completions", json=body) as response,
            ):
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks.append(time.monotonic())
                        if len(self.chunks) >= WARM_CHUNKS:
                            self.warm.set()
                    if self.stop.is_set() or time.monotonic() > deadline:
                        return
        except Exception as exc:  # recorded: a stream that breaks is a result
            self.error = repr(exc)[:300]
        finally:
            self.warm.set()

    def max_gap(self, since: float) -> float | None:
        times = [t for t in self.chunks if t >= since]
        if len(self.chunks) < WARM_CHUNKS or len(times) < 2:
            return None
        return round(max(b - a for a, b in itertools.pairwise(times)), 3)


def send(url: str, route: str, body: bytes) -> dict[str, Any]:
    """One huge prompt: its status, its error code (or Anthropic type) and how long it took."""
    began = time.monotonic()
    try:
        with httpx.Client(base_url=url, timeout=LIMIT_S) as client:
            response = client.post(
                route, content=body, headers={"content-type": "application/json"}
            )
    except httpx.HTTPError as exc:
        return {"route": route, "answer": repr(exc)[:200], "seconds": None, "status": None}
    took = round(time.monotonic() - began, 3)
    try:
        error = response.json().get("error") or {}
    except ValueError:
        error = {}
    code = error.get("code") or error.get("type") or ""
    param = f" ({error['param']})" if error.get("param") else ""
    answer = f"{response.status_code} {code}{param}".strip()
    return {"route": route, "answer": answer, "seconds": took, "status": response.status_code}


def measure(server: Server, count: int, streams: int, size: int) -> dict[str, Any]:
    text = (LINE * (size // len(LINE) + 1))[:size]
    bodies = {route: huge_body(route, text) for route in ROUTES}
    stop_probe, stop_streams = threading.Event(), threading.Event()
    rss_before = rss_mb(server.proc.pid)
    probe = Probe(server, stop_probe)
    probe.start()
    running = [Stream(server.url, i, stop_streams) for i in range(streams)]
    for stream in running:
        stream.start()
    for stream in running:
        stream.warm.wait(LIMIT_S)
    health_before = len(probe.health)
    began = time.monotonic()
    answers: list[dict[str, Any]] = [{} for _ in range(count)]

    def one(index: int) -> None:
        route = ROUTES[index % len(ROUTES)]
        answers[index] = send(server.url, route, bodies[route])

    senders = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(LIMIT_S)
    wall = time.monotonic() - began
    time.sleep(1.0)  # the streams and /health a moment after the burst
    stop_streams.set()
    stop_probe.set()
    for thread in [*running, probe]:
        thread.join(60)
    during = probe.health[health_before:]
    gaps = [stream.max_gap(began) for stream in running]
    seconds = [a["seconds"] for a in answers if a.get("seconds") is not None]
    incidents = server_incidents(server)
    return {
        "health": {
            "polls": len(during),
            "failures": probe.failures,
            "p50_s": rounded(percentile(during, 0.5)),
            "p99_s": rounded(percentile(during, 0.99)),
            "p100_s": rounded(max(during, default=None)),
        },
        "streams": {
            "count": streams,
            "max_gap_s": max((g for g in gaps if g is not None), default=None),
            "max_gap_each_s": gaps,
            "errors": [s.error for s in running if s.error],
        },
        "front_rss_mb": {
            "before": rss_before,
            "peak": max(probe.rss, default=None),
            "after": rss_mb(server.proc.pid),
        },
        "huge_prompts": {
            "count": count,
            "bytes": size,
            "answers": dict(Counter(a.get("answer", "no answer") for a in answers)),
            "by_route": {
                route: dict(Counter(a["answer"] for a in answers if a.get("route") == route))
                for route in ROUTES
            },
            "answered_p50_s": rounded(percentile(seconds, 0.5)),
            "answered_p100_s": rounded(max(seconds, default=None)),
            "all_answered_s": round(wall, 3),
        },
        "incidents": incidents,
    }


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def server_incidents(server: Server) -> list[dict[str, Any]]:
    detail = httpx.get(f"{server.url}/ready", timeout=30).json()
    found: list[dict[str, Any]] = detail.get("incidents", [])
    return found


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """Issue 27's targets, each from this run."""
    health = report["health"]["p100_s"]
    gap = report["streams"]["max_gap_s"]
    statuses = [int(a.split()[0]) for a in report["huge_prompts"]["answers"] if a[:3].isdigit()]
    answered = sum(report["huge_prompts"]["answers"].values())
    return {
        "health_p100_le_1s": health is not None and health <= 1.0,
        "stream_gap_le_2s": gap is not None and gap <= 2.0,
        "every_huge_prompt_4xx": len(statuses) == len(report["huge_prompts"]["answers"])
        and answered == report["huge_prompts"]["count"]
        and all(400 <= s < 500 for s in statuses),
        "no_incidents": not report["incidents"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=32, help="huge prompts sent at once")
    parser.add_argument("--streams", type=int, default=4, help="streams beside them")
    parser.add_argument("--bytes", type=int, default=3_900_000, help="each prompt's text")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": benchmark_device_apart(),
        "settings": {"model": MODEL, "count": args.count, "streams": args.streams},
    }
    server = mlxserve(MODEL, free_port())
    try:
        server.wait_ready()
        report.update(measure(server, args.count, args.streams, args.bytes))
    finally:
        server.stop()
    report["targets"] = targets(report)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    return 0 if all(report["targets"].values()) else 1


if __name__ == "__main__":
    threading.current_thread().name = "benchmark"
    sys.exit(main())
