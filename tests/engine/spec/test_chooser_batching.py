"""Requests with a `TokenChooser` decode inside decode batches, exact as alone.

A JSON-schema request and a penalised request with logprobs share batches with
plain ones, joining and leaving at different steps; each gets the greedy tokens
it gets alone, and the logprobs it reports alone (within float tolerance). Three
batch forms: ``CacheBatch`` (a generic mlx-lm model), ``RowBatch`` and
``MTPRowBatch`` (the DeepSeek-V4 demo, without and with its MTP module).
"""

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from llguidance import LLMatcher

from mlxserve.channel.request import GenerationParams, SamplingParams, TokenLogprob
from mlxserve.engine.core.build import materialize
from mlxserve.engine.core.request import FinishEvent, GenerationRequest, TokensEvent
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.engine.runner.batch import CacheBatch, MTPRowBatch, RowBatch
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.conftest import tiny_llama

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}
PENALISED = SamplingParams(presence_penalty=0.8, frequency_penalty=0.3, logprobs=3)

Result = tuple[list[int], list[TokenLogprob], FinishEvent]


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, Any]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    yield model, tokenizer


def requests(tokenizer: Any) -> tuple[list[GenerationRequest], list[GenerationRequest]]:
    """Two that start together, two that join later; different prompt and answer lengths."""
    options: Any = {"whitespace_flexible": False}
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options)
    stops = tuple(tokenizer.eos_token_ids)

    def ask(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(f"<|user|>{text}<|end|><|assistant|>"))

    first = [
        GenerationRequest(
            "plain-long", GenerationParams(ask("Python reference: the for statement"), 30)
        ),
        GenerationRequest(
            "json",
            GenerationParams(ask("JSON please"), 40, SamplingParams(), stops, grammar=grammar),
        ),
    ]
    later = [
        GenerationRequest(
            "penalised", GenerationParams(ask("The assert statement"), 18, PENALISED)
        ),
        GenerationRequest("plain-short", GenerationParams(ask("with"), 6)),
    ]
    return first, later


def drive(
    engine: Engine, first: list[GenerationRequest], later: list[GenerationRequest]
) -> dict[str, Result]:
    streams = [engine.submit(r) for r in first]
    for _ in range(8):
        engine.run_once()
    streams += [engine.submit(r) for r in later]
    for _ in range(2000):
        if not engine.run_once():
            break
    results: dict[str, Result] = {}
    for stream in streams:
        tokens: list[int] = []
        records: list[TokenLogprob] = []
        while True:
            event = stream.get(timeout=1)
            if isinstance(event, TokensEvent):
                tokens.extend(event.token_ids)
                records.extend(event.logprobs or ())
            else:
                assert isinstance(event, FinishEvent)
                assert event.finish_reason in ("stop", "length"), event.error
                results[stream.request_id] = (tokens, records, event)
                break
    return results


def check_batched_equals_alone(
    fresh: Callable[[list[Any]], Engine], tokenizer: Any, form: type
) -> None:
    first, later = requests(tokenizer)
    seen: list[Any] = []
    together = drive(fresh(seen), first, later)
    # The chooser rows were inside batches of the expected form with others.
    mixed = [(kind, rows) for kind, rows, chosen in seen if chosen and rows >= 2]
    assert mixed and all(kind is form for kind, _ in mixed), mixed
    assert max(n for _, n in mixed) >= 3
    for request in (*first, *later):
        alone = drive(fresh([]), [request], [])[request.request_id]
        tokens, records, _ = together[request.request_id]
        assert tokens == alone[0], request.request_id
        assert [r.token for r in records] == [r.token for r in alone[1]]
        for mine, theirs in zip(records, alone[1], strict=True):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
            assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top], abs=1e-3)
    value = json.loads(tokenizer.decode(together["json"][0]))
    assert isinstance(value["ok"], bool) and value["pick"] in ("red", "green", "blue")
    assert len(together["penalised"][1]) == len(together["penalised"][0])


def recording(engine: Engine, seen: list[Any]) -> Engine:
    """Record before each step every batch's form, size and whether it holds a chooser row."""

    def hook(plan: Any) -> None:
        for batch in engine.runner.batches:
            chosen = any(s.chooser is not None for s in batch.rows)
            seen.append((type(batch.state), len(batch.rows), chosen))

    engine.before_step = hook
    return engine


def test_chooser_rows_in_a_cache_batch(demo: tuple[Any, Any]) -> None:
    """A random generic mlx-lm model (``BatchKVCache`` rows) with the demo's tokenizer."""
    _, tokenizer = demo
    model = tiny_llama(seed=1, vocab=1024)
    grammars = Grammars(tokenizer, 1024)

    def fresh(seen: list[Any]) -> Engine:
        config = EngineConfig(prefill_step=64, max_running=4, prefix_cache_entries=0)
        return recording(Engine(PlainAdapter(model), config, grammars=grammars), seen)

    check_batched_equals_alone(fresh, tokenizer, CacheBatch)


@pytest.mark.parametrize("mtp", [False, True])
def test_chooser_rows_in_deepseek_v4_row_batches(demo: tuple[Any, Any], mtp: bool) -> None:
    """The demo's rows; with its MTP module (depth 3) the rows decode together and
    each one speculates again once it is alone."""
    model, tokenizer = demo
    grammars = Grammars(tokenizer, int(model.args.vocab_size))

    def fresh(seen: list[Any]) -> Engine:
        adapter = MTPAdapter(model) if mtp else PlainAdapter(model)
        config = EngineConfig(
            prefill_step=64, max_running=4, prefix_cache_entries=0, speculative_depth=3 * mtp
        )
        return recording(Engine(adapter, config, grammars=grammars), seen)

    check_batched_equals_alone(fresh, tokenizer, MTPRowBatch if mtp else RowBatch)
