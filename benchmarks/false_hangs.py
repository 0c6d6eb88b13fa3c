"""What only looks like an engine hang, against a real server: no hang, no incident.

    python benchmarks/false_hangs.py [--hold-s 60] [--pause-s 5] [--out false_hangs.json]

It starts `mlxserve serve` on the demo with default settings (hang floor 3 s,
client write timeout 30 s) and runs two of issue 27's probes in turn:

1. **A client that never reads**: one stream with `max_tokens` 1000, `n` 4 and 20
   alternatives per token (5 MB of answer) on a socket with a 4 KB receive buffer,
   held `--hold-s` without reading, while a short request is sent every second.
   The old detector declared the primary hung 3 s after the engine finished.
2. **A paused front**: four greedy streams, then the front itself SIGSTOPped for
   `--pause-s` and continued.

It prints one JSON document: for each probe the requests served meanwhile and
any that failed, how the non-reader's connection ended, every incident the
server recorded, its failovers and the "is hung" lines it logged; `targets`
checks 0 false hangs and 0 false incidents in each. The huge-prompt probe is
`benchmarks/huge_prompts.py`; both-backends-down is in `benchmarks/soak.py`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from huge_prompts import Stream
from servers import Server, free_port, mlxserve
from soak import hold_unread_stream

from mlxserve.hardware.probe import benchmark_device_apart

MODEL = "demo"


def short_request(url: str, index: int) -> str | None:
    """None when answered 200, else what went wrong."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Python reference {index}: for"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    except httpx.HTTPError as exc:
        return repr(exc)[:200]
    return None if response.status_code == 200 else f"{response.status_code} {response.text[:200]}"


def server_view(server: Server) -> dict[str, Any]:
    detail = httpx.get(f"{server.url}/ready", timeout=10).json()
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    failovers = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("mlxserve_failovers_total")
    )
    log = Path(server.log.name).read_text(errors="replace").splitlines()
    return {
        "incidents": detail["incidents"],
        "failovers": failovers,
        "hung_lines": [line for line in log if "is hung" in line],
        "cut_off_lines": [line for line in log if "read nothing" in line],
    }


def non_reader(server: Server, hold_s: float) -> dict[str, Any]:
    outcome: list[str] = []
    holder = threading.Thread(
        target=lambda: outcome.append(hold_unread_stream(server.url, hold_s)), daemon=True
    )
    began = time.monotonic()
    holder.start()
    served = 0
    failed: list[str] = []
    while holder.is_alive() and time.monotonic() - began < hold_s + 60:
        problem = short_request(server.url, served + len(failed))
        if problem is None:
            served += 1
        else:
            failed.append(problem)
        time.sleep(1.0)
    holder.join(60)
    return {
        "held_s": hold_s,
        "outcome": outcome[0] if outcome else "unknown",
        "served_meanwhile": served,
        "failed_meanwhile": failed[:10],
        **server_view(server),
    }


def paused_front(server: Server, pause_s: float) -> dict[str, Any]:
    stop = threading.Event()
    streams = [Stream(server.url, index, stop) for index in range(4)]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.warm.wait(120)
    server.proc.send_signal(signal.SIGSTOP)
    time.sleep(pause_s)
    server.proc.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    time.sleep(5)  # the streams go on after the pause; a declared hang would show by now
    stop.set()
    for stream in streams:
        stream.join(60)
    return {
        "pause_s": pause_s,
        "stream_errors": [s.error for s in streams if s.error],
        "chunks_after_pause": sum(1 for s in streams for t in s.chunks if t > resumed),
        "after_pause_served": short_request(server.url, 99) is None,
        **server_view(server),
    }


def clean(probe: dict[str, Any]) -> bool:
    return not probe["incidents"] and not probe["hung_lines"] and probe["failovers"] == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--hold-s", type=float, default=60.0, help="non-reader held (default 60)")
    parser.add_argument("--pause-s", type=float, default=5.0, help="front paused (default 5)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.hold_s <= 0 or args.pause_s <= 0:
        parser.error("--hold-s and --pause-s must be > 0")
    server = mlxserve(MODEL, free_port())
    try:
        server.wait_ready()
        reading = non_reader(server, args.hold_s)
        pausing = paused_front(server, args.pause_s)
    finally:
        server.stop()
    report: dict[str, Any] = {
        "benchmark": "false_hangs",
        "device": benchmark_device_apart(),
        "non_reading_client": reading,
        "paused_front": pausing,
        "targets": {
            "non_reader_no_false_hang": clean(reading) and not reading["failed_meanwhile"],
            "paused_front_no_false_hang": clean(pausing) and not pausing["stream_errors"],
        },
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if all(report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
