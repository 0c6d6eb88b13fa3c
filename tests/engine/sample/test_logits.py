"""`TokenChooser`'s pipelined choice: ``draw_next`` then ``take`` is ``choose``, split
so the mask is made before the draw is read, and a mask that fails is the failure of
the position it was made for, not of the token read before it."""

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from llguidance import LLMatcher

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.sample.grammar import GrammarError, Grammars
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import token_id

#: ``{"x":`` and then nothing: x's schema recurses with no way out.
STUCK = {
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/a"}},
    "required": ["x"],
    "additionalProperties": False,
    "$defs": {"a": {"$ref": "#/$defs/a"}},
}
LIST = {"type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def grammars() -> Iterator[tuple[Grammars, Any]]:
    from mlxserve.models import load

    model, tokenizer = load("demo")
    yield Grammars(tokenizer, int(model.args.vocab_size)), tokenizer


def compile_schema(grammars: Grammars, schema: dict[str, Any]) -> Any:
    options: Any = {"whitespace_flexible": False}
    return grammars.compile(str(LLMatcher.grammar_from_json_schema(schema, defaults=options)))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logprobs=2, presence_penalty=0.7),
        SamplingParams(temperature=0.9, seed=4, top_k=20, logprobs=1),
    ],
)
def test_draw_next_then_take_chooses_as_choose(
    grammars: tuple[Grammars, Any], params: SamplingParams
) -> None:
    compiled, _ = grammars
    whole = TokenChooser(params, compile_schema(compiled, LIST))
    split = TokenChooser(params, compile_schema(compiled, LIST))
    vocab = compiled.vocab_size
    for position in range(24):
        logits = mx.random.normal((vocab,), key=mx.random.key(position))
        key = mx.random.key(1000 + position)
        token = whole.choose(logits, key)
        drawn = split.draw_next(logits, key)
        # Drawn, not taken: nothing recorded yet.
        assert len(split.history) == position and not split.logprobs
        assert token_id(drawn) == token
        split.take(token)
        assert split.history == whole.history
        assert split.take_logprobs(1) == whole.take_logprobs(1)
        if whole.finished:
            break
    assert split.finished == whole.finished


def test_a_mask_that_fails_fails_its_own_position(grammars: tuple[Grammars, Any]) -> None:
    compiled, tokenizer = grammars
    chooser = TokenChooser(SamplingParams(), compile_schema(compiled, STUCK))
    for token in tokenizer.encode('{"x":', add_special_tokens=False):
        chooser.take(token)
    logits = mx.zeros((compiled.vocab_size,))
    # No token may follow: the draw gives a stand-in and keeps the failure...
    stand_in = chooser.draw_next(logits, mx.random.key(0))
    # ...which leaves the tokens taken as they were (not a completed grammar)...
    assert not chooser.finished
    # ...and is raised when the position's token is taken.
    with pytest.raises(GrammarError):
        chooser.take(token_id(stand_in))
    # As `choose` at that position fails.
    alone = TokenChooser(SamplingParams(), compile_schema(compiled, STUCK))
    for token in tokenizer.encode('{"x":', add_special_tokens=False):
        alone.take(token)
    with pytest.raises(GrammarError):
        alone.choose(logits, mx.random.key(0))
