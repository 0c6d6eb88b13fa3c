"""Soak: the bug report's rotation against a live server with a standby, under random faults.

    python benchmarks/soak.py [--minutes 10] [--fault-every-s 12] [--group] [--seed 0]
                              [--settle-s 15] [--out soak.json]

It starts `mlxserve` (the demo model, MTP depth 5) with a primary engine, or with
`--group` a primary group of two ring ranks on loopback, and a standby engine,
then repeats for `--minutes`:

1. a cold long prefill (a prompt no cache has seen, ~1,000 tokens);
2. decode at MTP depth 5 (64 greedy tokens, streamed);
3. TTFT with the prefix reused (a prompt served before, streamed);
4. two concurrent greedy decoders (streamed).

Meanwhile, at random (exponential gaps of mean `--fault-every-s`), it injects one
of `--faults`:

- into a random rank of the primary while it serves: `kill` (SIGKILL), `hang`
  (SIGSTOP: the front must declare it hung) or `crash` (SIGABRT);
- `both_down`: the primary and then, 0.5 s later, the standby killed: every
  backend restarts at once, and admitted requests must wait and resume;
- what only looks like a hang, which must record no incident: `nonreader` (a
  stream whose client never reads, held 20 s), `slow_reader` (a stream read a few
  bytes at a time), `huge_prompt` (a 3.9 MB prompt: a 400 from its size) and
  `front_pause` (the front itself SIGSTOPped for 5 s).

It prints one JSON document: requests sent, completed and lost (target: 0 lost),
the incidents the engine faults explain and the false ones beyond them (target: 0),
the rate of exact continuations (a greedy answer equal to the undisturbed one,
measured before any fault), the p50/p99 of the longest gap between chunks of a
streamed request (the stall a client sees), the faults injected, the incidents
and failovers the server counted, and the front's resident memory over time
(target: flat). Linux or macOS; loopback only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mlxserve.hardware.probe import benchmark_device_apart

REPO = Path(__file__).resolve().parents[1]
MODEL = "demo"
PROMPTS = {
    "decode": "Python reference: the for statement",
    "ttft": "Python reference: the with statement",
    "pair_a": "Python reference: lambda",
    "pair_b": "Python reference: import",
}
MAX_TOKENS = {"decode": 64, "ttft": 16, "pair_a": 48, "pair_b": 48}
ENGINE_FAULTS = ("kill", "hang", "crash")
CLIENT_FAULTS = ("nonreader", "slow_reader", "huge_prompt", "front_pause")
FAULTS = (*ENGINE_FAULTS, "both_down", *CLIENT_FAULTS)
FAULT_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "crash": signal.SIGABRT}
#: The incidents each fault explains (a client's or the front's own fault: none).
INCIDENTS_OF = {"kill": 1, "hang": 1, "crash": 1, "both_down": 2}
NONREADER_HOLD_S = 20.0
FRONT_PAUSE_S = 5.0
HUGE_PROMPT_BYTES = 3_900_000
MEMORY_EVERY_S = 5.0
#: How long the last fault's incident may take to be recorded once the rotation ends
#: (a frozen engine with no request in flight is found by two failed probes), the
#: default of ``--settle-s``. A fault that records none (a second SIGSTOP before the
#: first was declared, a fault on an engine already restarting) makes the run wait
#: all of it: CI's short soak, which needs one incident, passes 5.
INCIDENT_SETTLE_S = 15.0


def config(state: Path, group: bool) -> str:
    hosts = 'hosts = ["127.0.0.1", "127.0.0.1"]\n' if group else ""
    return f"""
model = "{MODEL}"
[speculative]
depth = 5
[policy]
overrides = ["progress_timeout_s=5"]
[cluster]
{hosts}
[server]
port = 0
ready_interval_s = 5.0
client_write_timeout_s = 5.0
retry_attempts = 10
retry_backoff_s = 0.2
retry_backoff_max_s = 2.0
restart_backoff_s = 0.2
restart_backoff_max_s = 2.0
state_dir = "{state}"
[[fallback]]
name = "standby"
model = "{MODEL}"
"""


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


def rss_mb(pid: int) -> float | None:
    """Resident memory of `pid` in MiB (ps works on Linux and macOS)."""
    result = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    text = result.stdout.strip()
    return round(int(text) / 1024, 1) if text.isdigit() else None


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (ps, so Linux and macOS)."""
    table = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True)
    children: dict[int, list[int]] = {}
    for line in table.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Server:
    def __init__(self, workdir: Path, group: bool) -> None:
        self.config = workdir / "config.toml"
        self.config.write_text(config(workdir / "state", group))
        self.log_path = workdir / "server.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLXSERVE_")}
        if "MLXSERVE_CACHE_DIR" in os.environ:
            env["MLXSERVE_CACHE_DIR"] = os.environ["MLXSERVE_CACHE_DIR"]
        env["OMP_NUM_THREADS"] = "1"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxserve", "--config", str(self.config)],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        self.url = ""

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {self.log_path}")
            if not self.url:
                for line in self.log_path.read_text().splitlines():
                    if "listening on http://" in line:
                        self.url = line.split("listening on ")[1].split(";")[0].strip()
            elif self.active() == "primary":
                return
            time.sleep(0.5)
        raise TimeoutError(f"the primary did not become ready; see {self.log_path}")

    def ready(self) -> dict[str, Any]:
        detail: dict[str, Any] = httpx.get(f"{self.url}/ready", timeout=10).json()
        return detail

    def incidents(self, count: int, timeout_s: float) -> list[dict[str, Any]]:
        """The incidents once `count` are recorded, or those there are after `timeout_s`:
        the front records a fault's incident when it has reaped the engine, which comes
        after the failover (for a frozen idle engine, probes later)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found: list[dict[str, Any]] = self.ready()["incidents"]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def active(self) -> str | None:
        try:
            return self.ready().get("active")
        except httpx.HTTPError:
            return None

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    lost: list[str] = field(default_factory=list)
    exact: int = 0
    checked: int = 0
    stalls: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def request(url: str, prompt: str, max_tokens: int, stream: bool) -> tuple[str, float]:
    """The answer's text and the longest gap between its chunks; raises on any failure."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    with httpx.Client(timeout=300) as client:
        if not stream:
            response = client.post(f"{url}/v1/chat/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["message"]["content"], 0.0
        parts: list[str] = []
        times = [time.monotonic()]
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                parts.append(chunk["choices"][0]["delta"].get("content") or "")
                times.append(time.monotonic())
        gaps = [b - a for a, b in itertools.pairwise(times[1:])]
        return "".join(parts), max(gaps, default=0.0)


def tracked(tally: Tally, url: str, name: str, prompt: str, want: str | None, stream: bool) -> None:
    with tally.lock:
        tally.sent += 1
    try:
        text, stall = request(url, prompt, MAX_TOKENS.get(name, 8), stream)
    except Exception as exc:  # a lost request is what this measures
        with tally.lock:
            tally.lost.append(f"{name}: {exc!r}"[:300])
        return
    with tally.lock:
        tally.completed += 1
        if stream:
            tally.stalls.append(stall)
        if want is not None:
            tally.checked += 1
            tally.exact += int(text == want)


def rotation(url: str, tally: Tally, references: dict[str, str], round_: int) -> None:
    words = " ".join(f"w{(i * 7 + round_) % 101}" for i in range(350))
    tracked(tally, url, "cold", f"round {round_}: {words}", None, stream=False)
    tracked(tally, url, "decode", PROMPTS["decode"], references["decode"], stream=True)
    tracked(tally, url, "ttft", PROMPTS["ttft"], references["ttft"], stream=True)
    pair = [
        threading.Thread(
            target=tracked, args=(tally, url, n, PROMPTS[n], references[n]), kwargs={"stream": True}
        )
        for n in ("pair_a", "pair_b")
    ]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join(600)


def hold_unread_stream(url: str, hold_s: float) -> str:
    """A stream whose client never reads, held `hold_s`: whether the server cut it off
    (its write timeout) or it was still open. Four choices of 1000 tokens with 20
    alternatives each: 5 MB, more than the kernel buffers on loopback (4 MB)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPTS["decode"]}],
            "max_tokens": 1000,
            "n": 4,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
            "stream": True,
        }
    ).encode()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
        sock.connect((host, int(port)))
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(hold_s)
        try:
            while sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            return "cut off"
        except TimeoutError:
            return "held"
        return "closed"


def read_slowly(url: str) -> str:
    """A stream read a kilobyte every 50 ms: slow, but a reader; it must complete."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS["pair_a"]}],
        "max_tokens": 200,
        "logprobs": True,
        "top_logprobs": 5,
        "stream": True,
    }
    try:
        with (
            httpx.Client(timeout=300) as client,
            client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
        ):
            data = b""
            for piece in response.iter_raw(1024):
                data += piece
                time.sleep(0.05)
        return "completed" if b"data: [DONE]" in data else f"{response.status_code}, unfinished"
    except httpx.HTTPError as exc:
        return repr(exc)[:200]


def send_huge_prompt(url: str) -> str:
    text = "Python reference: " * (HUGE_PROMPT_BYTES // 18)
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    except httpx.HTTPError as exc:
        return repr(exc)[:200]
    code = response.json().get("error", {}).get("code") if response.status_code >= 400 else None
    return f"{response.status_code} {code or ''}".strip()


def inject_faults(
    server: Server,
    stop: threading.Event,
    every_s: float,
    rng: random.Random,
    kinds: tuple[str, ...] = FAULTS,
) -> tuple[list[dict[str, Any]], threading.Thread]:
    """The faults injected (filled in as they are; a client fault's `outcome` once it
    has one) and the thread injecting them, which ends once `stop` is set and its
    current fault, if any, is in."""
    injected: list[dict[str, Any]] = []
    clients: list[threading.Thread] = []

    def in_background(record: dict[str, Any], work: Any, *args: Any) -> None:
        def run() -> None:
            record["outcome"] = work(*args)

        thread = threading.Thread(target=run, name=record["kind"], daemon=True)
        thread.start()
        clients.append(thread)

    def engine_fault(kind: str, detail: dict[str, Any]) -> bool:
        primary = detail["backends"][0]
        if detail.get("active") != "primary" or not primary.get("pid"):
            return False  # one engine fault at a time: wait for the primary to be back
        pid = int(primary["pid"])
        if kind == "both_down":
            standby = next((b for b in detail["backends"][1:] if b.get("pid")), None)
            if standby is None:
                return False
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
            os.kill(int(standby["pid"]), signal.SIGKILL)
            return True
        ranks = [pid, *descendants(pid)] if primary["kind"] == "group" else [pid]
        if primary["kind"] == "group":
            ranks = ranks[1:] or ranks  # the ranks, not their launcher
        os.kill(rng.choice(ranks), FAULT_SIGNALS[kind])
        return True

    def run() -> None:
        while not stop.wait(rng.expovariate(1 / every_s)):
            kind = rng.choice(kinds)
            record: dict[str, Any] = {"at_s": round(time.monotonic() - began, 1), "kind": kind}
            if kind == "nonreader":
                in_background(record, hold_unread_stream, server.url, NONREADER_HOLD_S)
            elif kind == "slow_reader":
                in_background(record, read_slowly, server.url)
            elif kind == "huge_prompt":
                in_background(record, send_huge_prompt, server.url)
            elif kind == "front_pause":
                server.proc.send_signal(signal.SIGSTOP)
                time.sleep(FRONT_PAUSE_S)
                server.proc.send_signal(signal.SIGCONT)
            else:
                try:
                    if not engine_fault(kind, server.ready()):
                        continue
                except (httpx.HTTPError, ProcessLookupError):
                    continue
            injected.append(record)
        for thread in clients:
            thread.join(NONREADER_HOLD_S + 60)

    began = time.monotonic()
    thread = threading.Thread(target=run, name="faults", daemon=True)
    thread.start()
    return injected, thread


def sample_memory(server: Server, stop: threading.Event) -> list[tuple[float, float | None]]:
    samples: list[tuple[float, float | None]] = []
    began = time.monotonic()

    def run() -> None:
        while not stop.wait(MEMORY_EVERY_S):
            samples.append((round(time.monotonic() - began, 1), rss_mb(server.proc.pid)))

    samples.append((0.0, rss_mb(server.proc.pid)))
    threading.Thread(target=run, name="memory", daemon=True).start()
    return samples


def soak(
    minutes: float,
    every_s: float,
    group: bool,
    seed: int,
    settle_s: float = INCIDENT_SETTLE_S,
    kinds: tuple[str, ...] = FAULTS,
) -> dict[str, Any]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="mlxserve-soak-") as tmp:
        server = Server(Path(tmp), group)
        try:
            server.wait_ready()
            references = {
                name: request(server.url, prompt, MAX_TOKENS[name], stream=False)[0]
                for name, prompt in PROMPTS.items()
            }
            tally = Tally()
            stop = threading.Event()
            memory = sample_memory(server, stop)
            faults, injector = inject_faults(server, stop, every_s, rng, kinds)
            began = time.monotonic()
            rounds = 0
            while time.monotonic() - began < minutes * 60:
                rotation(server.url, tally, references, rounds)
                rounds += 1
            stop.set()
            elapsed = time.monotonic() - began
            # A fault it was injecting as the rotation ended counts too, and so do the
            # outcomes of the client faults still running.
            injector.join(NONREADER_HOLD_S + 90)
            explained = sum(INCIDENTS_OF.get(f["kind"], 0) for f in faults)
            incidents = server.incidents(explained, settle_s)
            failovers = server.metric("mlxserve_failovers_total")
        finally:
            code = server.stop()
        log_tail = server.log_path.read_text().splitlines()[-20:] if tally.lost else []
    known = [mb for _, mb in memory if mb is not None]
    return {
        "benchmark": "soak",
        "device": benchmark_device_apart(),
        "primary": "group of 2 ring ranks" if group else "engine",
        "minutes": round(elapsed / 60, 2),
        "rounds": rounds,
        "sent": tally.sent,
        "completed": tally.completed,
        "lost": len(tally.lost),
        "lost_detail": tally.lost[:10],
        "exact_continuations": tally.exact,
        "exact_rate": round(tally.exact / tally.checked, 4) if tally.checked else None,
        "stall_p50_s": percentile(tally.stalls, 0.5),
        "stall_p99_s": percentile(tally.stalls, 0.99),
        "faults": faults,
        "incidents": len(incidents),
        "incidents_explained": explained,
        "false_incidents": max(0, len(incidents) - explained),
        "incident_kinds": [f"{i['backend']}:{i['kind']}" for i in incidents],
        "failovers": failovers,
        "front_rss_mb": memory,
        "front_rss_growth_mb": round(known[-1] - known[0], 1) if len(known) > 1 else None,
        "server_exit_code": code,
        "server_log_tail": log_tail,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long (default: 10)")
    parser.add_argument(
        "--fault-every-s", type=float, default=12.0, help="mean gap between faults (default: 12)"
    )
    parser.add_argument("--group", action="store_true", help="primary: 2 ring ranks on loopback")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=INCIDENT_SETTLE_S,
        help="at the end, how long to wait for the faults' incidents (default: 15)",
    )
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated fault kinds to draw from (default: all of {', '.join(FAULTS)})",
    )
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.minutes <= 0 or args.fault_every_s <= 0 or args.settle_s < 0:
        parser.error("--minutes and --fault-every-s must be > 0, --settle-s >= 0")
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(FAULTS))
    if not kinds or unknown:
        parser.error(f"--faults: unknown kind(s) {', '.join(unknown) or '(none given)'}")
    report = soak(args.minutes, args.fault_every_s, args.group, args.seed, args.settle_s, kinds)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
