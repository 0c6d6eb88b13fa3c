"""The front's client connections, over real sockets against the real uvicorn front:
Nagle off, a deadline for a request's headers and body to arrive, a connection cap."""

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from mlxserve.commands.serve import bind
from mlxserve.server.connections import FrontH11Protocol
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend
from tests.server.front import (
    connect,
    parse_response,
    post,
    read_response,
    read_until_closed,
    running_front,
)

CHAT = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}).encode()
MESSAGES = json.dumps(
    {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
).encode()
TIMEOUT_S = 0.5  # header_timeout_s and body_timeout_s of these tests
#: How long past its deadline a connection may take to be closed on a loaded machine.
SLACK_S = 5.0


# -- Nagle ---------------------------------------------------------------------------------


async def _app(scope: object, receive: object, send: object) -> None:  # never called
    raise AssertionError


async def server_side_nodelay(protocol: type[H11Protocol]) -> int:
    config = uvicorn.Config(_app, http=protocol, lifespan="off")
    config.load()
    state = ServerState()
    made: list[H11Protocol] = []

    def factory() -> H11Protocol:
        made.append(protocol(config=config, server_state=state, app_state={}))
        return made[-1]

    listener = bind("127.0.0.1", 0)
    server = await asyncio.get_running_loop().create_server(factory, sock=listener)
    try:
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        for _ in range(200):
            if made and made[0].transport is not None:
                break
            await asyncio.sleep(0.01)
        sock = made[0].transport.get_extra_info("socket")
        value = int(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()
        await writer.wait_closed()
        return value
    finally:
        server.close()
        await server.wait_closed()


def test_the_fronts_connections_have_nagle_off() -> None:
    """The front binds its listening socket itself (protocol number 0), and asyncio
    only turns Nagle off for sockets created with IPPROTO_TCP."""
    assert asyncio.run(server_side_nodelay(H11Protocol)) == 0  # why the protocol does it
    assert asyncio.run(server_side_nodelay(FrontH11Protocol)) != 0


# -- deadlines ------------------------------------------------------------------------------


@pytest.fixture
def front(tokenizer: FrontTokenizer) -> Iterator[tuple[str, int]]:
    runtime = make_runtime(
        tokenizer,
        [FakeBackend("primary").up()],
        header_timeout_s=TIMEOUT_S,
        body_timeout_s=TIMEOUT_S,
    )
    with running_front(runtime) as address:
        yield address


class _Collect(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def errors_logged(
    front: tuple[str, int], caplog: pytest.LogCaptureFixture
) -> Iterator[Callable[[], list[str]]]:
    """The errors logged while the front serves: mlxserve's (pytest captures them), and
    uvicorn's, whose logger does not propagate (the handler is added once the front has
    set up uvicorn's logging, which would drop it)."""
    records: list[logging.LogRecord] = []
    handler = _Collect(records)
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)

    def logged() -> list[str]:
        found = records + [r for r in caplog.records if r.levelno >= logging.ERROR]
        return [record.getMessage() for record in found]

    try:
        yield logged
    finally:
        logger.removeHandler(handler)


def test_half_sent_headers_get_408_and_are_closed(front: tuple[str, int]) -> None:
    with connect(front) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-")
        raw, waited = read_until_closed(sock, TIMEOUT_S + SLACK_S)
    status, headers, body = parse_response(raw)
    assert (status, headers["connection"]) == (408, "close")
    assert body["error"]["code"] == "request_timeout"
    assert waited >= TIMEOUT_S * 0.8


def test_headers_trickling_in_do_not_move_the_deadline(front: tuple[str, int]) -> None:
    request = post("/v1/chat/completions", CHAT)
    with connect(front) as sock:
        began = time.monotonic()
        for byte in request[:40]:  # one byte every 50 ms: 2 s in all if nothing stops it
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
        raw, _ = read_until_closed(sock, TIMEOUT_S + SLACK_S)
    assert time.monotonic() - began < 40 * 0.05
    assert parse_response(raw)[0] == 408


def test_a_connection_that_sends_nothing_is_closed(front: tuple[str, int]) -> None:
    with connect(front) as sock:
        raw, waited = read_until_closed(sock, TIMEOUT_S + SLACK_S)
    assert raw == b""  # nothing was asked: nothing to answer
    assert waited >= TIMEOUT_S * 0.8


def test_many_half_sent_connections_are_all_closed(front: tuple[str, int]) -> None:
    socks = [connect(front) for _ in range(50)]
    try:
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        for sock in socks:
            read_until_closed(sock, TIMEOUT_S + SLACK_S)
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES)]
)
def test_a_body_that_stops_arriving_gets_408_in_the_routes_shape(
    front: tuple[str, int], errors_logged: Callable[[], list[str]], path: str, body: bytes
) -> None:
    request = post(path, body)
    with connect(front) as sock:
        sock.sendall(request[:-5])
        raw, _ = read_until_closed(sock, TIMEOUT_S + SLACK_S)
    status, headers, answer = parse_response(raw)
    assert (status, headers["connection"]) == (408, "close")
    if path == "/v1/messages":
        assert answer["type"] == "error"
        assert answer["error"]["type"] == "invalid_request_error"
    else:
        assert answer["error"]["code"] == "request_timeout"
    time.sleep(0.2)  # the handler, woken, finishes: without a logged error
    assert errors_logged() == []


def test_a_body_that_trickles_after_the_answer_is_cut_off(front: tuple[str, int]) -> None:
    """The handler answered (404: an unknown route reads no body) while the client keeps
    the body coming, a byte at a time: the deadline still holds."""
    request = post("/v1/nothing", b"x" * 100)
    with connect(front) as sock:
        sock.sendall(request[:-100])
        status, _, _ = read_response(sock)
        assert status == 404
        began = time.monotonic()
        for _ in range(100):  # 5 s if nothing stops it
            try:
                sock.sendall(b"x")
            except OSError:
                break
            time.sleep(0.05)
            if time.monotonic() - began > TIMEOUT_S + SLACK_S:
                break
        read_until_closed(sock, SLACK_S)
    assert time.monotonic() - began < TIMEOUT_S + SLACK_S


def test_kept_alive_connections_are_timed_per_request(front: tuple[str, int]) -> None:
    """Requests that arrive whole are served on one connection past the deadline's
    length; a request begun and not finished on it is then cut off."""
    with connect(front) as sock:
        for _ in range(3):
            sock.sendall(post("/v1/chat/completions", CHAT))
            assert read_response(sock)[0] == 200
            time.sleep(TIMEOUT_S * 0.6)
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        raw, waited = read_until_closed(sock, TIMEOUT_S + SLACK_S)
    assert parse_response(raw)[0] == 408
    assert waited >= TIMEOUT_S * 0.8


# -- the cap --------------------------------------------------------------------------------


def test_connections_past_the_cap_get_503_and_are_closed(tokenizer: FrontTokenizer) -> None:
    runtime = make_runtime(tokenizer, [FakeBackend("primary").up()], max_connections=2)
    with running_front(runtime) as address:
        held = [connect(address) for _ in range(2)]
        try:
            time.sleep(0.2)  # both made on the server's side
            with connect(address) as third:
                third.sendall(post("/v1/messages", MESSAGES))
                raw, _ = read_until_closed(third, SLACK_S)
            status, headers, body = parse_response(raw)
            assert status == 503
            assert "retry-after" in headers
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            held[0].sendall(post("/v1/chat/completions", CHAT))  # within the cap: served
            assert read_response(held[0])[0] == 200
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + SLACK_S
        while True:  # the held ones' closing reaches the server a moment later
            with connect(address) as again:
                again.sendall(post("/v1/chat/completions", CHAT))
                status, _, _ = read_response(again)
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
