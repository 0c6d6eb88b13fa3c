"""Run requests to completion on the calling thread.

For callers that step the engine themselves instead of running its loop
(`mlxserve.engine.process.loop.EngineLoop`), which the engine process does
while it serves: single-shot ones (`mlxserve generate`, benchmarks) and the
engine process's warm-up before it serves.
"""

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlxserve.engine.core.request import Event, FinishEvent, GenerationRequest, TokensEvent
from mlxserve.engine.core.stepper import Engine, RequestStream

# A request cannot need more steps than this; a bound, not a budget.
MAX_STEPS = 10_000_000

# Called with each batch of new tokens; returns True to cancel the request.
TokenCallback = Callable[[tuple[int, ...]], bool]
# Called with every event of the requests being run, as it is taken from its stream.
EventCallback = Callable[[Event], None]


@dataclass(frozen=True)
class Completed:
    tokens: list[int]
    finish: FinishEvent
    ttft_s: float
    total_s: float
    # This process's CPU seconds, the same two spans: on a CPU device shared with
    # other work, what decoding cost this process, steadier than the wall clock.
    cpu_ttft_s: float = 0.0
    cpu_total_s: float = 0.0


def drain(stream: RequestStream) -> list[Event]:
    """The events that are ready now, without waiting."""
    events: list[Event] = []
    while True:
        try:
            events.append(stream.get(timeout=0))
        except queue.Empty:
            return events


def run_until_finished(
    engine: Engine,
    requests: Sequence[GenerationRequest],
    on_event: EventCallback | None = None,
    max_steps: int = MAX_STEPS,
) -> dict[str, FinishEvent]:
    """Submit `requests` and step the engine until each has finished; their finish
    events by request id. `on_event` sees every event (tokens and finishes) in order.

    Raises RuntimeError naming a request that did not finish: the engine went idle
    without finishing it, or `max_steps` steps passed.
    """
    streams = [engine.submit(request) for request in requests]
    finished: dict[str, FinishEvent] = {}
    for _ in range(max_steps):
        progressed = engine.run_once()
        for stream in streams:
            for event in drain(stream):
                if on_event is not None:
                    on_event(event)
                if isinstance(event, FinishEvent):
                    finished[event.request_id] = event
        if len(finished) == len(streams):
            return finished
        if not progressed and engine.scheduler.idle:
            break  # nothing left to run, so the missing finish events can never come
    missing = next(r.request_id for r in requests if r.request_id not in finished)
    raise RuntimeError(f"request {missing} did not finish")


def run_to_completion(
    engine: Engine, request: GenerationRequest, on_tokens: TokenCallback | None = None
) -> Completed:
    """Run one request; its tokens, finish and timings (to the first token and the end)."""
    started = time.perf_counter()
    cpu_started = time.process_time()
    tokens: list[int] = []
    first_token: list[tuple[float, float]] = []  # (wall, CPU) when the first came

    def seen(event: Event) -> None:
        if not isinstance(event, TokensEvent):
            return
        if not first_token:
            first_token.append((time.perf_counter(), time.process_time()))
        tokens.extend(event.token_ids)
        if on_tokens is not None and on_tokens(event.token_ids):
            engine.cancel(request.request_id)

    finish = run_until_finished(engine, [request], seen)[request.request_id]
    now, cpu_now = time.perf_counter(), time.process_time()
    first_at, first_cpu = first_token[0] if first_token else (now, cpu_now)
    return Completed(
        tokens,
        finish,
        first_at - started,
        now - started,
        first_cpu - cpu_started,
        cpu_now - cpu_started,
    )
