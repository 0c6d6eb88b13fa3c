"""Thinking, then a grammar, under speculation: exact as depth 0.

A thinking request's grammar starts with free reasoning up to its end marker (a
lexeme with ``stop=``, `mlxserve.server.constraints.after_reasoning`), then the
answer's grammar: a JSON object, a JSON schema, a forced tool call or one call of
several tools. llguidance cannot roll such a grammar back, and speculative rounds
rolled their drafts back: every round failed (``cannot roll back 2 tokens``). Now a
round reads its drafts into a fork of the grammar, and the request's own grammar
reads only the tokens it emits.

On the DeepSeek-V4 demo: at depths 0, 1, 3 and automatic, greedy and seeded, each
answer is depth 0's, alone and drafting together with the others. The demo closes
no ``</think>`` in a few dozen tokens, so besides the real marker a newline ends
the reasoning, and the answer's grammar is reached inside the rounds.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.chat.request import Function
from mlxserve.engine.core.build import materialize
from mlxserve.engine.core.request import FinishEvent, GenerationRequest
from mlxserve.engine.core.stepper import Engine
from mlxserve.engine.sample.grammar import Grammar, Grammars
from mlxserve.server.constraints import (
    after_reasoning,
    forced_tool_grammar,
    response_format_grammar,
)
from mlxserve.server.protocol import ResponseFormat
from mlxserve.server.tokenizer import FrontTokenizer
from tests.engine.drive import run
from tests.engine.spec.test_chooser_batching import SCHEMA
from tests.engine.spec.test_seeds import DEPTHS, depth_engines

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[3] / "mlxserve" / "models" / "demo" / "weights"
WEATHER = Function(
    "get_weather",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = Function("get_time", parameters={"type": "object", "properties": {}})
GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=0.8, seed=3)


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, Any, Grammars]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    materialize(model)
    yield model, tokenizer, Grammars(tokenizer, int(model.args.vocab_size))


@pytest.fixture(scope="module")
def answers() -> dict[str, str]:
    """The answers' grammars: JSON object, JSON schema, forced tool, required."""
    front = FrontTokenizer.load(DEMO)
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    kinds = {
        "json_object": response_format_grammar(
            ResponseFormat.model_validate({"type": "json_object"}), front
        ),
        "json_schema": response_format_grammar(ResponseFormat.model_validate(schema), front),
        "forced_tool": forced_tool_grammar("json_tools", [("tools.0", WEATHER)], False, front),
        "required": forced_tool_grammar(
            "dsml", [("tools.0", WEATHER), ("tools.1", CLOCK)], False, front
        ),
    }
    out = {}
    for name, grammar in kinds.items():
        assert grammar is not None
        for end in ("</think>", "\n"):
            out[f"{name} {end!r}"] = after_reasoning(grammar, end, front, "response_format")
    return out


@pytest.fixture(scope="module")
def engines(demo: tuple[Any, Any, Grammars]) -> dict[int | str, Engine]:
    model, _, grammars = demo
    return depth_engines(model, rows=8, batch_depth=3, grammars=grammars)


def request(tokenizer: Any, rid: str, grammar: str, sampling: SamplingParams) -> GenerationRequest:
    prompt = tuple(tokenizer.encode("<|user|>JSON please<|end|><|assistant|>"))
    stops = tuple(tokenizer.eos_token_ids)
    return GenerationRequest(rid, GenerationParams(prompt, 32, sampling, stops, grammar=grammar))


def check(results: dict[str, tuple[list[int], FinishEvent]]) -> dict[str, list[int]]:
    for rid, (_, finish) in results.items():
        assert finish.finish_reason in ("stop", "length"), (rid, finish.error)
    return {rid: tokens for rid, (tokens, _) in results.items()}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_thinking_with_a_grammar_at_every_depth(
    demo: tuple[Any, Any, Grammars],
    answers: dict[str, str],
    engines: dict[int | str, Engine],
    sampling: SamplingParams,
) -> None:
    """Each answer alone at depth 0 is the reference: the five drafting together
    (decode batch at depth 0, batched rounds at the others) and, greedy, two alone at
    depth 3 (their own rounds) give it again."""
    _, tokenizer, _ = demo
    chosen = ["json_object '</think>'", *(name for name in answers if "\\n" in name)]
    requests = [request(tokenizer, name, answers[name], sampling) for name in chosen]
    base = {r.request_id: check(run(engines[0], r))[r.request_id] for r in requests}
    for name in chosen[1:]:  # the newline's reasoning ended: its answer was reached
        assert "\n" in tokenizer.decode(base[name]), name
    for depth in DEPTHS:
        assert check(run(engines[depth], *requests)) == base, depth
    if sampling.greedy:  # the real marker's and a tool call's own rounds
        for one in (requests[0], requests[-1]):
            assert check(run(engines[3], one))[one.request_id] == base[one.request_id]


def test_a_grammar_reads_only_the_tokens_emitted(
    demo: tuple[Any, Any, Grammars],
    answers: dict[str, str],
    engines: dict[int | str, Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request's grammar (not the rounds' forks) is fed its emitted tokens and
    nothing else, although the rounds read drafts they did not keep."""
    _, tokenizer, _ = demo
    compiled: list[Grammar] = []
    fed: dict[int, list[int]] = {}
    compile_, accept = Grammars.compile, Grammar.accept

    def compiling(self: Grammars, text: str) -> Grammar:
        compiled.append(compile_(self, text))
        return compiled[-1]

    def accepting(self: Grammar, token: int) -> None:
        fed.setdefault(id(self), []).append(token)
        accept(self, token)

    monkeypatch.setattr(Grammars, "compile", compiling)
    monkeypatch.setattr(Grammar, "accept", accepting)
    one = request(tokenizer, "r", answers["json_schema '\\n'"], GREEDY)
    tokens, finish = run(engines[3], one)["r"]
    assert (
        finish.speculative is not None
        and finish.speculative["drafted"] > finish.speculative["accepted"] > 0
    )
    assert len(compiled) == 1
    taken = fed[id(compiled[0])]
    assert taken[: len(tokens)] == tokens and all(
        t in one.params.stop_token_ids for t in taken[len(tokens) :]
    )
