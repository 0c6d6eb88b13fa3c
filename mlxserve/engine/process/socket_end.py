"""The engine process's side of the channel: one front connection, JSON lines both ways.

`FrontLink` (`mlxserve.engine.process.front_link`) owns the socket: any thread
may send lines without waiting on the front; one thread reads lines. `FrontDesk`
turns the front's messages into engine calls and forwards the requests' events:
each request's stream collects them in its link's `Outbox`, and after every
engine step (`Engine.deliver`, on the engine loop's thread) what the step emitted
goes out in one write, one `tokens` line per request. No thread is woken per
token or per request: one thread per request, each woken for its line and a
system call, took the GIL from the engine loop 16 times a step at 16 requests
(measured on a 2-core CPU: the engine process spent about 0.3 ms more per token
serving than stepping). A slow front never stalls the engine: what the socket
cannot take waits in the link's backlog for its writer.

Nothing the front sends can end the process: a bad line gets an `Error`
reply and the connection keeps serving.
"""

import json
import logging
import threading
from collections import deque
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
from mlxserve.engine.process.front_link import MAX_LINE_BYTES, TOO_LONG, FrontLink

log = logging.getLogger(__name__)

# Cancels of requests that finished this recently are not errors (they raced the finish).
RECENT_IDS: Final = 4096
# How often the step counter is reported while the engine has work (the front's hang check).
REPORT_S: Final = 0.2

_MISSING_TYPE: Final = "missing 'type': expected generate, cancel or status"
_MESSAGE_TYPES: dict[str, type[BaseModel]] = {
    "generate": Generate,
    "cancel": Cancel,
    "status": StatusRequest,
}


class Outbox:
    """The events of one link's requests since they were last delivered, in the order
    the engine emitted them. Only the engine loop's thread puts and takes."""

    def __init__(self, link: FrontLink) -> None:
        self.link = link
        self._events: list[Event] = []

    def put(self, event: Event) -> None:
        self._events.append(event)

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events


class RelayedStream(RequestStream):
    """A request's stream whose events go to its link's outbox (delivered after the step)."""

    def __init__(self, request_id: str, outbox: Outbox) -> None:
        super().__init__(request_id)
        self._outbox = outbox

    def put(self, event: Event) -> None:
        self._outbox.put(event)


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
        # The outboxes of the links served (the old one's until its requests finish).
        self._outboxes: dict[FrontLink, Outbox] = {}
        self._outboxes_lock = threading.Lock()
        engine.deliver = self.deliver

    def serve(self, link: FrontLink) -> None:
        """Hello, then the front's messages until it goes; its unfinished requests are cancelled."""
        try:
            with self._outboxes_lock:
                self._outboxes[link] = Outbox(link)
            if not link.send(encode(self.hello)):
                return
            threading.Thread(
                target=self._report, args=(link,), name="mlxserve-progress", daemon=True
            ).start()
            for line in link.read_lines(self.stopping):
                reply = self.handle_line(link, line)
                if reply is not None:
                    link.send(encode(reply))
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
            if not link.send(encode(report)):
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
        with self._outboxes_lock:
            outbox = self._outboxes[link]
        self.engine.submit(request, RelayedStream(message.id, outbox))
        return None

    def _cancel(self, link: FrontLink, request_id: str) -> Error | None:
        owner = self.table.owner(request_id)
        if owner is link:
            self.engine.cancel(request_id)
            return None
        if owner is not None or self.table.recently_finished(request_id):
            return None  # finishing already, or raced its own finish: nothing to do
        return Error(id=request_id, message="unknown request id")

    def deliver(self) -> None:
        """Send what the requests emitted since the last call, on the engine loop's thread
        after each step: one write per link, one `tokens` line per request (`coalesce`:
        a request's tokens of several steps, when the loop delivered late, in one line).

        A closed link's outbox stays while its requests may still finish (the engine
        cancels them when the front goes): their ids are released as they do."""
        with self._outboxes_lock:
            outboxes = list(self._outboxes.values())
        for outbox in outboxes:
            events = outbox.take()
            link = outbox.link
            if not events:
                if link.closed and not self.table.owned_by(link):
                    with self._outboxes_lock:
                        self._outboxes.pop(link, None)
                continue
            lines: list[bytes] = []
            for request_id, run in by_request(events).items():
                for ready in coalesce(run):
                    if isinstance(ready, TokensEvent):
                        lines.append(encode(to_tokens(ready)))
                        continue
                    # Released before the finish is sent, so the front may reuse the id.
                    self.table.release(request_id)
                    lines.append(encode(to_finish(ready)))
            link.send(b"".join(lines))


def by_request(events: list[Event]) -> dict[str, list[Event]]:
    """``events`` grouped by request, each request's in order (first seen first)."""
    grouped: dict[str, list[Event]] = {}
    for event in events:
        grouped.setdefault(event.request_id, []).append(event)
    return grouped


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
