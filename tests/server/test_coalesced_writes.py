"""Writes made in one turn of the event loop leave in one send, over a real loopback
connection; what was written before a close still arrives, an abort drops it."""

import asyncio
import socket

from mlxserve.server.coalesced_writes import CoalescedWrites

RECV_TIMEOUT_S = 10.0


class _Counting(asyncio.Protocol):
    """The asyncio transport's protocol; counts nothing itself (the transport is real)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


async def _pair() -> tuple[CoalescedWrites, asyncio.Transport, socket.socket]:
    """A coalescing transport over a real connection, the real transport, and its peer."""
    loop = asyncio.get_running_loop()
    ours, peer = socket.socketpair()
    peer.settimeout(RECV_TIMEOUT_S)
    transport, _ = await loop.create_connection(_Counting, sock=ours)
    assert isinstance(transport, asyncio.Transport)
    return CoalescedWrites(transport, loop), transport, peer


def _read_all(peer: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = peer.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def test_writes_of_one_turn_go_out_together_and_in_order() -> None:
    async def main() -> tuple[list[int], bytes]:
        coalesced, transport, peer = await _pair()
        sent: list[int] = []
        write = transport.write

        def counted(data: bytes | bytearray | memoryview) -> None:
            sent.append(len(data))
            write(data)

        transport.write = counted  # type: ignore[method-assign]
        for piece in (b"head ", b"role ", b"first "):
            coalesced.write(piece)
        assert sent == []  # nothing yet: the turn is not over
        await asyncio.sleep(0)
        coalesced.write(b"second")
        await asyncio.sleep(0)
        received = _read_all(peer, len(b"head role first second"))
        coalesced.close()
        peer.close()
        return sent, received

    sent, received = asyncio.run(main())
    assert sent == [len(b"head role first "), len(b"second")]
    assert received == b"head role first second"


def test_a_close_sends_what_was_written_and_an_abort_does_not() -> None:
    async def main() -> tuple[bytes, bytes]:
        closed, _, closed_peer = await _pair()
        closed.write(b"the end")
        closed.close()  # in the same turn as the write
        aborted, _, aborted_peer = await _pair()
        aborted.write(b"dropped")
        aborted.abort()
        await asyncio.sleep(0.05)
        got = _read_all(closed_peer, 64), _read_all(aborted_peer, 64)
        closed_peer.close()
        aborted_peer.close()
        return got

    closed, aborted = asyncio.run(main())
    assert closed == b"the end"
    assert aborted == b""


def test_the_buffer_size_counts_what_waits() -> None:
    async def main() -> tuple[int, int]:
        coalesced, _, peer = await _pair()
        coalesced.write(b"12345")
        waiting = coalesced.get_write_buffer_size()
        await asyncio.sleep(0)
        _read_all(peer, 5)
        after = coalesced.get_write_buffer_size()
        coalesced.close()
        peer.close()
        return waiting, after

    waiting, after = asyncio.run(main())
    assert waiting == 5 and after == 0
