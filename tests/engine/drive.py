"""Drive an engine from a test: submit, step it to completion, collect the events."""

from mlxserve.engine.core.request import FinishEvent, GenerationRequest, TokensEvent
from mlxserve.engine.core.stepper import Engine, RequestStream


def collect(stream: RequestStream, timeout: float = 1) -> tuple[list[int], FinishEvent]:
    """A finished request's tokens and finish event (each event within ``timeout``)."""
    tokens: list[int] = []
    while True:
        event = stream.get(timeout=timeout)
        if isinstance(event, TokensEvent):
            tokens.extend(event.token_ids)
        else:
            assert isinstance(event, FinishEvent)
            return tokens, event


def run(engine: Engine, *requests: GenerationRequest) -> dict[str, tuple[list[int], FinishEvent]]:
    streams = [engine.submit(r) for r in requests]
    for _ in range(10_000):
        if not engine.run_once():
            break
    return {stream.request_id: collect(stream) for stream in streams}
