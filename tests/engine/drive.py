"""Drive an engine from a test: submit, step it to completion, collect the events."""

from mlxserve.engine.engine import Engine
from mlxserve.engine.request import FinishEvent, GenerationRequest, TokensEvent


def run(engine: Engine, *requests: GenerationRequest) -> dict[str, tuple[list[int], FinishEvent]]:
    streams = [engine.submit(r) for r in requests]
    for _ in range(10_000):
        if not engine.run_once():
            break
    results = {}
    for stream in streams:
        tokens: list[int] = []
        finish = None
        while finish is None:
            event = stream.get(timeout=1)
            if isinstance(event, TokensEvent):
                tokens.extend(event.token_ids)
            else:
                assert isinstance(event, FinishEvent)
                finish = event
        results[stream.request_id] = (tokens, finish)
    return results
