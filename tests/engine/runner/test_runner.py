"""A request with a `TokenChooser` decodes pipelined in its decode batch: each step
queues the forward fed by the token it drew before that token is read, so the token
a step emits was already the batch's next input after the step before, and the
chooser takes a token only when it is emitted (its grammar is never ahead)."""

from collections.abc import Iterator
from typing import Any

import pytest
from llguidance import LLMatcher

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.build import materialize
from mlxserve.engine.core.drive import drain
from mlxserve.engine.core.request import GenerationRequest, TokensEvent
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.sample.sampling import token_id
from mlxserve.engine.spec.mtp import MTPAdapter

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["city", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, Any]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    yield model, tokenizer


def test_a_chooser_row_decodes_pipelined(demo: tuple[Any, Any]) -> None:
    model, tokenizer = demo
    grammars = Grammars(tokenizer, int(model.args.vocab_size))
    options: Any = {"whitespace_flexible": False}
    grammar = str(LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options))
    prompt = tuple(tokenizer.encode("<|user|>A city as JSON<|end|><|assistant|>"))
    params = GenerationParams(
        prompt,
        40,
        SamplingParams(temperature=0.8, seed=3, logprobs=1),
        tuple(tokenizer.eos_token_ids),
        grammar,
    )
    config = EngineConfig(prefill_step=64, prefix_cache_entries=0, speculative_depth=0)
    engine = Engine(MTPAdapter(model), config, grammars=grammars)
    stream = engine.submit(GenerationRequest("r", params))
    queued: int | None = None  # the batch's next input after the last step
    emitted: list[int] = []
    batched_steps = 0
    for _ in range(200):
        progressed = engine.run_once()
        events = drain(stream)
        new = [t for e in events if isinstance(e, TokensEvent) for t in e.token_ids]
        if queued is not None and new:
            assert new == [queued]  # emitted now, queued as input the step before
            batched_steps += 1
        emitted += new
        batches = engine.runner.batches
        queued = None
        if batches and batches[0].tokens is not None:
            (row,) = batches[0].rows
            assert row.chooser is not None
            # Taken as emitted, never before: the queued token is not in the history.
            assert len(row.chooser.history) == len(emitted)
            queued = token_id(batches[0].tokens[0])
        if not progressed:
            break
    assert batched_steps >= 5
    assert emitted and engine.running == 0
