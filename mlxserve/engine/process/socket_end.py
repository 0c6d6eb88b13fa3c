"""The engine process's side of the channel: one front connection, JSON lines both ways.

`FrontLink` owns the socket: any thread may send a message (one at a time,
under a lock); one thread reads lines. `FrontDesk` turns the front's messages
into engine calls and forwards each request's events as they come: one
thread per in-flight request blocks on its `RequestStream` and writes one
line per event, so a token reaches the socket as soon as the engine emits it,
and a slow front never stalls the engine (events wait in the stream).

Nothing the front sends can end the process: a bad line gets an `Error`
reply and the connection keeps serving.
"""

import contextlib
import json
import logging
import queue
import selectors
import socket
import threading
from collections import deque
from collections.abc import Iterator
from typing import Final

from pydantic import BaseModel, ValidationError

from mlxserve.channel.messages import (
    Cancel,
    EngineMessage,
    Error,
    Finish,
    Generate,
    Hello,
    Progress,
    Status,
    StatusRequest,
    Tokens,
    decode_front,
    encode,
)
from mlxserve.engine.core.request import Event, FinishEvent, GenerationRequest, TokensEvent
from mlxserve.engine.core.stepper import Engine, RequestStream

log = logging.getLogger(__name__)

# One line holds a whole prompt: a million token ids is about 8 MB of JSON.
MAX_LINE_BYTES: Final = 32 << 20
# A front that reads nothing for this long is treated as gone.
SEND_TIMEOUT_S: Final = 30.0
# How often blocked readers and forwarders look at the stop flag.
POLL_S: Final = 0.5
# Cancels of requests that finished this recently are not errors (they raced the finish).
RECENT_IDS: Final = 4096
# How often the step counter is reported while the engine has work (the front's hang check).
REPORT_S: Final = 0.2

TOO_LONG: Final = object()
_MISSING_TYPE: Final = "missing 'type': expected generate, cancel or status"
_MESSAGE_TYPES: dict[str, type[BaseModel]] = {
    "generate": Generate,
    "cancel": Cancel,
    "status": StatusRequest,
}


class FrontLink:
    """The socket to one front process."""

    def __init__(self, sock: socket.socket, send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        # The timeout bounds sendall; reads only happen once the selector says data is there.
        sock.settimeout(send_timeout_s)
        self.sock = sock
        self._lock = threading.Lock()
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, message: EngineMessage) -> bool:
        """Write one line; False (and the link closes) if the front is gone or stuck."""
        data = encode(message)
        with self._lock:
            if self._closed.is_set():
                return False
            try:
                self.sock.sendall(data)
            except OSError as exc:  # includes timeouts and a closed peer
                log.warning("front link: send failed (%s); dropping the connection", exc)
                self.hang_up()
                return False
        return True

    def hang_up(self) -> None:
        """Stop all traffic: wakes the reader and any blocked sender. Any thread, any time."""
        self._closed.set()
        with contextlib.suppress(OSError):  # already closed or never connected
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Hang up and release the socket; only by the reading thread, once it is done reading."""
        self.hang_up()  # a sender blocked in sendall fails at once, so the lock frees quickly
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


class RequestTable:
    """Requests submitted to the engine and not finished yet, across connections.

    Request ids must be unique among these: the engine keys its streams by id.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[str, FrontLink] = {}
        self._recent: deque[str] = deque(maxlen=RECENT_IDS)

    def claim(self, request_id: str, link: FrontLink) -> bool:
        with self._lock:
            if request_id in self._owners:
                return False
            self._owners[request_id] = link
            return True

    def release(self, request_id: str) -> None:
        with self._lock:
            if self._owners.pop(request_id, None) is not None:
                self._recent.append(request_id)

    def owner(self, request_id: str) -> FrontLink | None:
        with self._lock:
            return self._owners.get(request_id)

    def recently_finished(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._recent

    def owned_by(self, link: FrontLink) -> list[str]:
        with self._lock:
            return [rid for rid, owner in self._owners.items() if owner is link]

    def __len__(self) -> int:
        with self._lock:
            return len(self._owners)


class FrontDesk:
    """Serves front connections, one at a time, on behalf of one engine."""

    def __init__(self, engine: Engine, hello: Hello, vocab_size: int | None) -> None:
        self.engine = engine
        self.hello = hello
        self.vocab_size = vocab_size
        self.table = RequestTable()
        self.stopping = threading.Event()

    def serve(self, link: FrontLink) -> None:
        """Hello, then the front's messages until it goes; its unfinished requests are cancelled."""
        try:
            if not link.send(self.hello):
                return
            threading.Thread(
                target=self._report, args=(link,), name="mlxserve-progress", daemon=True
            ).start()
            for line in link.read_lines(self.stopping):
                reply = self.handle_line(link, line)
                if reply is not None:
                    link.send(reply)
        except Exception:  # a bug here must not take the engine down with it
            log.exception("front connection failed")
        finally:
            link.close()
            orphans = self.table.owned_by(link)
            for request_id in orphans:
                self.engine.cancel(request_id)
            log.info("front disconnected; cancelled %d in-flight request(s)", len(orphans))

    def _report(self, link: FrontLink) -> None:
        """Send the step counter every REPORT_S while there is work (or it just moved).

        A counter, not a heartbeat: this thread keeps running while a step is
        wedged, and the front sees the number stand still.
        """
        sent = self.engine.progress
        while not link.closed and not self.stopping.wait(REPORT_S):
            engine = self.engine
            steps = engine.progress
            step = engine.current_step
            busy = step is not None or engine.running > 0 or engine.queue_depth > 0
            if not busy and steps == sent:
                continue
            expected = engine.step_times.expected_s(step)
            kind = step.kind if step is not None else None
            report = Progress(steps=steps, busy=busy, expected_step_s=expected, step_kind=kind)
            if not link.send(report):
                return
            sent = steps

    def handle_line(self, link: FrontLink, line: bytes | object) -> EngineMessage | None:
        """The reply to one line from the front, if any (tokens and finishes come later)."""
        if line is TOO_LONG:
            return Error(message=f"line longer than {MAX_LINE_BYTES} bytes; dropped")
        assert isinstance(line, bytes)
        if not line.strip():
            return None
        try:
            message = decode_front(line)
        except ValidationError as exc:
            request_id, reason = describe_invalid(line, exc)
            return Error(id=request_id, message=reason)
        if "type" not in message.model_fields_set:
            # Every message type has a default "type", so pydantic would guess one.
            request_id = message.id if isinstance(message, Generate | Cancel) else None
            return Error(id=request_id, message=_MISSING_TYPE)
        if isinstance(message, Generate):
            return self._generate(link, message)
        if isinstance(message, Cancel):
            return self._cancel(link, message.id)
        return Status(
            running=self.engine.running,
            queued=self.engine.queue_depth,
            progress=self.engine.progress,
        )

    def _generate(self, link: FrontLink, message: Generate) -> Error | None:
        try:
            request = to_request(message, self.vocab_size)
        except ValueError as exc:
            return Error(id=message.id, message=f"invalid generate message: {exc}")
        if not self.table.claim(message.id, link):
            return Error(
                id=message.id, message="duplicate request id: a request with it is running"
            )
        stream = self.engine.submit(request)
        forwarder = threading.Thread(
            target=self._forward,
            args=(link, stream),
            name=f"mlxserve-forward-{message.id[:32]}",
            daemon=True,
        )
        try:
            forwarder.start()
        except RuntimeError as exc:  # out of threads: give the request back
            self.engine.cancel(message.id)
            self.table.release(message.id)
            return Error(id=message.id, message=f"cannot serve the request now: {exc}")
        return None

    def _cancel(self, link: FrontLink, request_id: str) -> Error | None:
        owner = self.table.owner(request_id)
        if owner is link:
            self.engine.cancel(request_id)
            return None
        if owner is not None or self.table.recently_finished(request_id):
            return None  # finishing already, or raced its own finish: nothing to do
        return Error(id=request_id, message="unknown request id")

    def _forward(self, link: FrontLink, stream: RequestStream) -> None:
        """Write the request's events to the front as they come, until its finish.

        The events that are already waiting when it wakes go out together, their
        tokens in one `tokens` line (`coalesce`): when the front or this thread falls
        behind the engine, it catches up in one line and one wake-up of the front,
        not one per step."""
        request_id = stream.request_id
        while True:
            try:
                event = stream.get(timeout=POLL_S)
            except queue.Empty:
                if self.stopping.is_set():
                    self.table.release(request_id)
                    return
                continue
            for ready in coalesce([event, *stream.ready()]):
                if isinstance(ready, TokensEvent):
                    link.send(to_tokens(ready))
                    continue
                # Released before the finish is sent, so the front may reuse the id at once.
                self.table.release(request_id)
                link.send(to_finish(ready))
                return


def to_request(message: Generate, vocab_size: int | None) -> GenerationRequest:
    """The engine's request for a `generate` message; ValueError says what is wrong."""
    if vocab_size is not None:
        bad = [t for t in message.params.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
            )
    return GenerationRequest.of(message)


def coalesce(events: list[Event]) -> list[Event]:
    """``events`` in order, each run of `TokensEvent` merged into one (its tokens, and
    logprobs where every one of the run has them); nothing after a `FinishEvent`."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if (
            isinstance(event, TokensEvent)
            and isinstance(last, TokensEvent)
            and (last.logprobs is None) == (event.logprobs is None)
        ):
            logprobs = None
            if last.logprobs is not None and event.logprobs is not None:
                logprobs = (*last.logprobs, *event.logprobs)
            ids = (*last.token_ids, *event.token_ids)
            out[-1] = TokensEvent(event.request_id, ids, logprobs)
            continue
        out.append(event)
        if isinstance(event, FinishEvent):
            break
    return out


def to_tokens(event: TokensEvent) -> Tokens:
    return Tokens(id=event.request_id, token_ids=list(event.token_ids), logprobs=event.logprobs)


def to_finish(event: FinishEvent) -> Finish:
    return Finish(
        id=event.request_id,
        finish_reason=event.finish_reason,
        prompt_tokens=event.usage.prompt_tokens,
        completion_tokens=event.usage.completion_tokens,
        cached_tokens=event.usage.cached_tokens,
        speculative=event.speculative,
        error=event.error,
        memory=event.memory,
    )


def describe_invalid(line: bytes, exc: ValidationError) -> tuple[str | None, str]:
    """The request id (when one can be read) and a one-line reason a front line was rejected."""
    try:
        raw = json.loads(line)
    except ValueError:
        return None, "not valid JSON"
    if not isinstance(raw, dict):
        return None, "expected a JSON object with a 'type'"
    request_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    kind = raw.get("type")
    if kind is None:
        return request_id, _MISSING_TYPE
    model = _MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        shown = repr(kind)[:40]
        return request_id, f"unknown message type {shown}; expected generate, cancel or status"
    errors = exc.errors()
    try:
        model.model_validate(raw)
    except ValidationError as specific:
        errors = specific.errors()  # only this type's complaints, not every union member's
    parts = [
        f"{'.'.join(str(p) for p in error['loc']) or '(message)'}: {error['msg']}"
        for error in errors[:3]
    ]
    return request_id, f"invalid {kind} message: {'; '.join(parts)}"
