"""The front's client connections: Nagle off, requests that arrive in time, answers
that are read in time, a cap.

uvicorn's h11 protocol with five additions, each a fix for what was measured:

* **TCP_NODELAY on every connection.** Measured (benchmarks/serve.py, one client,
  tiny llama on a CPU): the first token reached the client after ~50 ms although the
  engine had produced all 16 tokens after 15 ms; every chunk arrived in the same
  instant. asyncio turns Nagle's algorithm off only for sockets whose protocol
  number is IPPROTO_TCP, and the listening socket the front binds itself (before
  the engines start, so a busy port is a clean error) has protocol 0; its
  connections inherit that. So Nagle held each small SSE chunk until the client
  acknowledged the previous write, which clients delay by up to 40 ms.
* **A deadline for each request to arrive.** uvicorn times out only a kept-alive
  connection that sends nothing: 200 connections that sent half a request line
  were held 60 s, each with its file descriptor and buffers, until their clients
  gave up. Here a request's headers must arrive within `header_timeout_s` of the
  connection's start (on a kept-alive connection, of the request's first byte)
  and its body within `body_timeout_s` after them. A late request is answered
  408 in the API's error JSON where a response can still be written (some of it
  came, the handler has not answered), and its connection is closed.
* **A deadline for the client to read.** A streaming response writes faster than
  a client that does not read can take: the kernel's buffers fill, then the
  transport's (uvicorn pauses writing at its high-water mark), and the handler
  waits in `send` for as long as the client likes, holding its slot. Eight such
  clients held every running slot for minutes. What waits per stream stays
  bounded (the transport's high-water mark, plus at most the request's
  `max_tokens` queued on the front), and once writing has been paused for
  `client_write_timeout_s` the connection is aborted: the app sees a disconnect,
  as when a client goes away, so the request is cancelled in the engine and its
  slot freed. The engine is never blamed: it finished its work
  (`mlxserve.reliability.hang`).
* **One send for what is ready together** (`mlxserve.server.coalesced_writes`): the
  writes of one turn of the event loop (a stream's headers, role and first token;
  its last token, finish, usage and ``[DONE]``) go out in one system call.
* **A cap on open connections.** Past `max_connections`, a request is answered 503
  in the API's error JSON, with Retry-After, and its connection closed (uvicorn's
  own `limit_concurrency` answers in plain text, and counts running requests too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxserve.config import ServerSettings
from mlxserve.server.coalesced_writes import CoalescedWrites
from mlxserve.server.errors import APIError, RequestTimeout, TooManyConnections, error_response

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    retry_after_s: int
    write_timeout_s: float = 0.0

    @classmethod
    def of(cls, server: ServerSettings) -> ConnectionLimits:
        return cls(
            server.header_timeout_s,
            server.body_timeout_s,
            server.max_connections,
            server.retry_after_s,
            server.client_write_timeout_s,
        )


class FrontH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with Nagle off, arrival deadlines and a connection cap.

    `with_limits` gives the class to hand uvicorn; this one has none of the limits.
    """

    limits: ClassVar[ConnectionLimits | None] = None

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[FrontH11Protocol]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "headers" or "body", while a deadline runs
        self._write_stall: asyncio.TimerHandle | None = None  # while writing is paused

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A response's pieces ready in one turn go out in one send (`coalesced_writes`).
        super().connection_made(CoalescedWrites(transport, self.loop))
        if self.limits is not None and len(self.connections) > self.limits.max_connections:
            self.app = self._over_capacity
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may take a pipelined request's buffered bytes
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._reading_again()
        super().connection_lost(exc)

    # -- a client that does not read ---------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stall is None and self.limits is not None and self.limits.write_timeout_s:
            self._write_stall = self.loop.call_later(self.limits.write_timeout_s, self._not_reading)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._reading_again()

    def _reading_again(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def _not_reading(self) -> None:
        self._write_stall = None
        assert self.limits is not None
        host, port = self.client or ("?", 0)
        log.warning(
            "client %s:%s read nothing for %g s while its response waited: "
            "closing the connection (its request is cancelled)",
            host,
            port,
            self.limits.write_timeout_s,
        )
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset: what the kernel still holds for it is dropped too
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    # -- deadlines ----------------------------------------------------------------

    def _arm(self) -> None:
        """Start, keep or stop the deadline for what the connection waits for now. A
        deadline is set once per phase and never moved: bytes trickling in do not
        extend it."""
        if self.limits is None:
            return
        waiting_for = self._phase()
        if waiting_for == self._waiting_for:
            return
        self._disarm()
        if waiting_for is not None:
            timeout = (
                self.limits.header_timeout_s
                if waiting_for == "headers"
                else self.limits.body_timeout_s
            )
            self._deadline = self.loop.call_later(timeout, self._expired)
            self._waiting_for = waiting_for

    def _phase(self) -> str | None:
        if self.transport is None or self.transport.is_closing():
            return None
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return "body"
        if state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            return "headers"  # a new connection, or a request begun on a kept-alive one
        return None  # the request is in (or the connection is done); idle: uvicorn's keep-alive

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._waiting_for = None

    def _expired(self) -> None:
        waiting_for = self._waiting_for
        self._deadline = None
        self._waiting_for = None
        if self.transport.is_closing():
            return
        assert self.limits is not None
        if waiting_for == "headers":
            begun = self.conn.trailing_data[0]
            if begun:  # a client that asked something hears why it was cut off
                error = RequestTimeout(
                    f"the request's headers did not arrive within "
                    f"{self.limits.header_timeout_s:g} s"
                )
                self.transport.write(_raw_response(error, _request_path(begun)))
        else:
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                cycle.disconnected = True  # the handler's own answer, if any, goes nowhere
                cycle.message_event.set()  # and its read of the body ends
                error = RequestTimeout(
                    f"the request's body did not arrive within {self.limits.body_timeout_s:g} s"
                )
                self.transport.write(_raw_response(error, cycle.scope["path"]))
        self.transport.close()

    # -- the cap --------------------------------------------------------------------

    async def _over_capacity(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.limits is not None
        error = TooManyConnections(
            f"the server has {self.limits.max_connections} connections open, its most; "
            "retry shortly",
            retry_after_s=self.limits.retry_after_s,
            headers={"Connection": "close"},
        )
        await error_response(error, scope.get("path", ""))(scope, receive, send)


def _request_path(begun: bytes) -> str:
    """The path of a request line that has arrived (``POST /v1/messages HTTP/1.1``), so
    a late request is answered in its route's error shape; "" when it has not."""
    line, found, _ = begun.partition(b"\r\n")
    parts = line.split(b" ")
    if not found or len(parts) != 3:
        return ""
    return parts[1].partition(b"?")[0].decode("latin-1")


def _raw_response(error: APIError, path: str) -> bytes:
    """`error` as the route at `path` answers it, as a whole HTTP/1.1 response written
    straight to the socket before it closes: h11 cannot send one for a request it has
    not seen whole."""
    response = error_response(error, path)
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}".encode()]
    head += [name + b": " + value for name, value in response.raw_headers]
    head.append(b"connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + bytes(response.body)
