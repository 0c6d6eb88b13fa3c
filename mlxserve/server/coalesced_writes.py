"""A client connection's writes made in one turn of the event loop, sent in one write.

A streamed answer writes its pieces one `send` at a time (uvicorn writes each ASGI
message to the transport, which sends at once when nothing waits): the headers,
the role chunk and the first token's chunk are three system calls and three
packets although they are ready together, and so are the last token's chunk, the
finish chunk, the usage chunk, ``[DONE]`` and the end of the chunked body (five).
On loopback the send is a streamed token's largest cost in the front (its whole
TCP path runs in the sender: 0.2 ms of the front's time per send under load,
profiled on the project's 2-core CPU), and each packet also wakes the client. So
writes are gathered until the loop's current turn ends (``call_soon``) and go out
together: a 64-token chat answer takes 64 sends instead of 71. Nothing waits
longer than that turn, so a token is not held back for the next one (Nagle's
delay stays off: `mlxserve.server.connections`).
"""

from __future__ import annotations

import asyncio
from typing import Any


class CoalescedWrites(asyncio.Transport):
    """``transport``, but the writes of one loop turn go out in one ``write``."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    # -- writing ---------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Hand what waits to the transport now (the end of the turn does it)."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(p) for p in self._pending)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        limits: tuple[int, int] = self._transport.get_write_buffer_limits()
        return limits

    # -- closing: what was written goes first, unless aborted -------------------------

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    # -- the rest, as the transport has it --------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()
