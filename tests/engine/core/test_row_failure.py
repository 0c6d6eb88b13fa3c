"""A request whose own token choice fails (its grammar) fails alone: the rows it
shares a step with go on, and each gets the tokens it gets alone.

The failing grammar is a schema whose value has no finite form: llguidance takes
``{"x":``, then has no token to allow (the front refuses such a schema with a 400;
the engine must survive one all the same). Three rows decode together: that one, a
JSON-schema row and a plain one, in a decode batch (depth 0) and in batched
speculative rounds (depth 3, where the failure comes while a draft is read).
"""

from collections.abc import Iterator
from typing import Any

import pytest
from llguidance import LLMatcher

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.build import materialize
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.drive import collect, run
from tests.engine.spec.test_chooser_batching import SCHEMA

pytestmark = pytest.mark.slow

#: ``{"x":`` and then nothing: x's schema recurses with no way out.
STUCK = {
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/a"}},
    "required": ["x"],
    "additionalProperties": False,
    "$defs": {"a": {"$ref": "#/$defs/a"}},
}


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, Any, Grammars]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    yield model, tokenizer, Grammars(tokenizer, int(model.args.vocab_size))


def grammar(schema: dict[str, Any]) -> str:
    options: Any = {"whitespace_flexible": False}
    return str(LLMatcher.grammar_from_json_schema(schema, defaults=options))


@pytest.mark.parametrize("depth", [0, 3])
def test_a_row_whose_grammar_fails_fails_alone(demo: tuple[Any, Any, Grammars], depth: int) -> None:
    model, tokenizer, grammars = demo
    stops = tuple(tokenizer.eos_token_ids)

    def ask(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(f"<|user|>{text}<|end|><|assistant|>"))

    def engine() -> Engine:
        config = EngineConfig(
            prefill_step=64,
            prefix_cache_entries=0,
            speculative_depth=depth,
            max_running=4,
            max_speculative_batch=4,
            batch_speculative_depth=2,
        )
        return Engine(MTPAdapter(model), config, grammars=grammars)

    def constrained(rid: str, schema: dict[str, Any]) -> GenerationRequest:
        params = GenerationParams(ask("JSON please"), 30, SamplingParams(), stops, grammar(schema))
        return GenerationRequest(rid, params)

    stuck = constrained("stuck", STUCK)
    others = [
        constrained("json", SCHEMA),
        GenerationRequest(
            "plain", GenerationParams(ask("Python reference: the for statement"), 24)
        ),
    ]
    steps: list[Step] = []
    together = engine()
    together.before_step = steps.append
    streams = [together.submit(r) for r in others]
    for _ in range(4):  # the others decode when it comes
        together.run_once()
    streams.append(together.submit(stuck))
    while together.run_once():
        pass
    results = {stream.request_id: collect(stream) for stream in streams}
    tokens, finish = results["stuck"]
    assert finish.finish_reason == "error" and finish.error is not None
    assert finish.error.startswith("GrammarError"), finish.error
    assert '{"x":'.startswith(tokenizer.decode(tokens))
    # The failure came in a step the three shared (a batch's).
    last = max(i for i, step in enumerate(steps) if "stuck" in step.request_ids)
    assert len(steps[last].request_ids) == 3
    assert steps[last].kind == ("decode" if depth == 0 else "speculate")
    for request in others:
        alone, _ = run(engine(), request)[request.request_id]
        mine, done = results[request.request_id]
        assert done.finish_reason in ("stop", "length"), done.error
        assert mine == alone, request.request_id
    assert together.running == 0 and not together.runner.batches
