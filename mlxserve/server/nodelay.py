"""Stream tokens as they come: TCP_NODELAY on every client connection.

Measured (benchmarks/serve.py, one client, tiny llama on a CPU): the first
token reached the client after ~50 ms although the engine had produced all 16
tokens after 15 ms; every chunk arrived in the same instant. asyncio turns
Nagle's algorithm off only for sockets whose protocol number is IPPROTO_TCP,
and the listening socket the front binds itself (before the engines start, so
a busy port is a clean error) has protocol 0; its connections inherit that. So
Nagle held each small SSE chunk until the client acknowledged the previous
write, which clients delay by up to 40 ms. This protocol sets TCP_NODELAY on
each connection as it is made.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class NoDelayH11Protocol(H11Protocol):
    """uvicorn's h11 protocol on a connection with Nagle's algorithm off."""

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)
