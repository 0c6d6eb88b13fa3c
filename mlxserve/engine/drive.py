"""Run one request to completion on the calling thread.

For single-shot callers (`mlxserve generate`, benchmarks): they step the
engine themselves instead of starting its thread, which the server does.
"""

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from mlxserve.engine.engine import Engine, RequestStream
from mlxserve.engine.request import Event, FinishEvent, GenerationRequest, TokensEvent

# A request cannot need more steps than this; a bound, not a budget.
MAX_STEPS = 10_000_000

# Called with each batch of new tokens; returns True to cancel the request.
TokenCallback = Callable[[tuple[int, ...]], bool]


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


def run_to_completion(
    engine: Engine, request: GenerationRequest, on_tokens: TokenCallback | None = None
) -> Completed:
    started = time.perf_counter()
    cpu_started = time.process_time()
    stream = engine.submit(request)
    tokens: list[int] = []
    first_token_at = 0.0
    first_token_cpu = 0.0
    for _ in range(MAX_STEPS):
        progressed = engine.run_once()
        for event in drain(stream):
            if isinstance(event, TokensEvent):
                if not first_token_at:
                    first_token_at, first_token_cpu = time.perf_counter(), time.process_time()
                tokens.extend(event.token_ids)
                if on_tokens is not None and on_tokens(event.token_ids):
                    engine.cancel(request.request_id)
            else:
                now, cpu_now = time.perf_counter(), time.process_time()
                ttft = (first_token_at or now) - started
                cpu_ttft = (first_token_cpu or cpu_now) - cpu_started
                return Completed(
                    tokens, event, ttft, now - started, cpu_ttft, cpu_now - cpu_started
                )
        if not progressed and engine.scheduler.idle:
            break  # nothing left to run, so the finish event can never come
    raise RuntimeError(f"request {request.request_id} did not finish")
