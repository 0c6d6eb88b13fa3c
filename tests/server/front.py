"""The real HTTP front in-process: uvicorn with the serve command's settings on a free
loopback port, around any runtime (fakes included), for tests that need real sockets;
and a raw-socket client that bounds every wait."""

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from mlxserve.commands.serve import bind, http_config
from mlxserve.server.runtime import Runtime

START_TIMEOUT_S = 10.0


@contextlib.contextmanager
def running_front(runtime: Runtime) -> Iterator[tuple[str, int]]:
    """The front of `runtime` serving on 127.0.0.1; yields its address."""
    server = uvicorn.Server(http_config(runtime))
    listener = bind("127.0.0.1", 0)
    address: tuple[str, int] = listener.getsockname()[:2]
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the front did not start")
        time.sleep(0.01)
    try:
        yield address
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S + 10)
        listener.close()


def connect(address: tuple[str, int], timeout_s: float = 5.0) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout_s)
    sock.settimeout(timeout_s)
    return sock


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that
    took; `TimeoutError` if it is still open after `timeout_s`."""
    began = time.monotonic()
    received = b""
    while True:
        left = timeout_s - (time.monotonic() - began)
        if left <= 0:
            raise TimeoutError(f"still open after {timeout_s} s; got {received!r}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return received, time.monotonic() - began
        received += chunk


def read_response(sock: socket.socket, timeout_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body from a kept-alive connection."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response; got {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    while len(body) < int(headers.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside a response body")
        body += chunk
    return status, headers, body


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ")[1]), headers


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    """A whole response read until the connection closed: status, headers, JSON body."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status, headers = parse_head(head)
    return status, headers, json.loads(body)


def post(path: str, body: bytes, host: str = "127.0.0.1", **headers: str) -> bytes:
    """A POST with a JSON body, as bytes for a raw socket."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"host: {host}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
