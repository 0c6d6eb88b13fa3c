"""The engine's socket to its front: a send never waits on the front; what the socket
cannot take yet follows in order; a front that reads nothing for the send timeout is
dropped; a link that hung up refuses sends."""

import socket
import threading
import time

from mlxserve.engine.process.front_link import FrontLink

BUFFER = 4096  # small socket buffers, so a front that does not read fills them at once
LINES = 400
DEADLINE_S = 20.0


def _pair(send_timeout_s: float = 30.0) -> tuple[FrontLink, socket.socket]:
    ours, front = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
    front.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    return FrontLink(ours, send_timeout_s), front


def _line(i: int) -> bytes:
    return b'{"type":"tokens","id":"r","token_ids":[%d]}\n' % i


def _read(front: socket.socket, size: int) -> bytes:
    front.settimeout(DEADLINE_S)
    data = b""
    while len(data) < size:
        chunk = front.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


def test_sends_never_wait_for_the_front_and_arrive_in_order() -> None:
    link, front = _pair()
    lines = [_line(i) for i in range(LINES)]
    began = time.monotonic()
    for line in lines:
        assert link.send(line)
    sending_s = time.monotonic() - began
    assert link.waiting_bytes > 0  # the front read nothing: the socket could not take it all
    assert sending_s < DEADLINE_S / 4  # no send waited for the front
    expected = b"".join(lines)
    assert _read(front, len(expected)) == expected
    link.close()
    front.close()


def test_later_sends_queue_behind_what_waits() -> None:
    link, front = _pair()
    big = b"x" * (8 * BUFFER) + b"\n"
    assert link.send(big)
    assert link.send(_line(1))  # must not overtake the big line's rest
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(_read(front, len(big) + 40)))
    reader.start()
    reader.join(DEADLINE_S)
    assert received and received[0].startswith(big) and received[0][len(big) :] == _line(1)
    link.close()
    front.close()


def test_a_front_that_reads_nothing_is_dropped() -> None:
    link, front = _pair(send_timeout_s=0.3)
    for i in range(LINES):
        link.send(_line(i))
    deadline = time.monotonic() + DEADLINE_S
    while not link.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert link.closed
    assert not link.send(_line(0))
    link.close()
    front.close()


def test_a_link_that_hung_up_refuses_sends() -> None:
    link, front = _pair()
    link.hang_up()
    assert not link.send(_line(0))
    link.close()
    front.close()
