"""The engine process's socket to one front: lines out without ever blocking the
sender, lines in on one reading thread.

Any thread may send (the engine loop its requests' tokens after each step, the
progress reporter, the reader its replies). A send writes what the socket takes at
once (the socket is non-blocking underneath) and leaves the rest to the link's
writer thread, which waits for the front to read; while the writer holds bytes,
later sends queue behind them, so lines never interleave. So the engine loop sends
a step's tokens itself, with no thread woken in the usual case, and a front that
stops reading never stalls it (what it cannot take waits in memory, as before in
the per-request streams). The writer gives up on a front that reads nothing for
`send_timeout_s` and hangs up.
"""

import contextlib
import logging
import os
import selectors
import socket
import threading
from collections import deque
from collections.abc import Iterator
from typing import Final

log = logging.getLogger(__name__)

# One line holds a whole prompt: a million token ids is about 8 MB of JSON.
MAX_LINE_BYTES: Final = 32 << 20
# A front that reads nothing for this long is treated as gone.
SEND_TIMEOUT_S: Final = 30.0
# How often blocked readers and writers look at the stop flag.
POLL_S: Final = 0.5

TOO_LONG: Final = object()


class FrontLink:
    """The socket to one front process."""

    def __init__(self, sock: socket.socket, send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        # The timeout bounds the writer's sendall (and puts the socket in non-blocking
        # mode underneath, which the senders' first attempt relies on); reads only
        # happen once the selector says data is there.
        sock.settimeout(send_timeout_s)
        self.sock = sock
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # Bytes the socket did not take yet, oldest first; the writer owns them while
        # `_writing` (then new sends queue here behind them).
        self._backlog: deque[bytes] = deque()
        self._writing = False
        self._wake = threading.Event()
        self._writer: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, data: bytes) -> bool:
        """Write ``data`` (whole lines), never waiting on the front: what the socket does
        not take now, the writer sends later, in order. False once the link is closed."""
        with self._lock:
            if self._closed.is_set():
                return False
            if not self._backlog and not self._writing:
                try:
                    sent = os.write(self.sock.fileno(), data)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:  # a closed peer
                    log.warning("front link: send failed (%s); dropping the connection", exc)
                    self.hang_up()
                    return False
                data = data[sent:]
            if data:
                self._backlog.append(data)
                self._start_writer()
                self._wake.set()
        return True

    def _start_writer(self) -> None:
        """Under the lock: the writer thread, once something waits for it."""
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write, name="mlxserve-link-writer", daemon=True
            )
            self._writer.start()

    def _write(self) -> None:
        """Send the backlog as the front reads it, until the link closes."""
        while not self._closed.is_set():
            if not self._wake.wait(POLL_S):
                continue
            with self._lock:
                if not self._backlog:
                    self._wake.clear()
                    continue
                data = b"".join(self._backlog)
                self._backlog.clear()
                self._writing = True
            try:
                self.sock.sendall(data)
            except OSError as exc:  # includes the timeout and a closed peer
                log.warning("front link: send failed (%s); dropping the connection", exc)
                self.hang_up()
            finally:
                with self._lock:
                    self._writing = False

    @property
    def waiting_bytes(self) -> int:
        """Bytes sent but not yet taken by the socket (the writer's)."""
        with self._lock:
            return sum(len(data) for data in self._backlog)

    def hang_up(self) -> None:
        """Stop all traffic: wakes the reader and the writer. Any thread, any time."""
        self._closed.set()
        self._wake.set()
        with contextlib.suppress(OSError):  # already closed or never connected
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Hang up and release the socket; only by the reading thread, once it is done reading."""
        self.hang_up()  # a writer blocked in sendall fails at once
        writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join(POLL_S)
        with self._lock:
            self.sock.close()

    def read_lines(self, stop: threading.Event) -> Iterator[bytes | object]:
        """The front's lines (without the newline) until EOF, an error, close or `stop`.

        A line longer than MAX_LINE_BYTES is dropped and reported once as TOO_LONG.
        """
        buffer = bytearray()
        discarding = False
        with selectors.DefaultSelector() as selector:
            selector.register(self.sock, selectors.EVENT_READ)
            while not stop.is_set() and not self.closed:
                if not selector.select(POLL_S):
                    continue
                try:
                    chunk = self.sock.recv(1 << 16)
                except (BlockingIOError, InterruptedError, TimeoutError):
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                scanned = len(buffer)  # a long line is searched for its newline only once
                buffer += chunk
                while (end := buffer.find(b"\n", scanned)) >= 0:
                    line = bytes(buffer[:end])
                    del buffer[: end + 1]
                    scanned = 0
                    if discarding:
                        discarding = False  # the rest of the long line ends here
                    elif len(line) > MAX_LINE_BYTES:
                        yield TOO_LONG
                    else:
                        yield line
                if discarding:
                    buffer.clear()  # more of a line already reported as too long
                elif len(buffer) > MAX_LINE_BYTES:
                    buffer.clear()
                    discarding = True
                    yield TOO_LONG
