"""Every field of a generation's record walks from the HTTP body to the engine's sampler.

Each field of `GenerationParams` and of its `SamplingParams` (a new one fails here until
it is walked) is set alone, in an HTTP body, to a value other than the baseline's; the
record the router hands a backend must differ from the baseline's in that field only,
by the value asked for, and reach the engine unchanged: as the local backend writes it
to the engine's socket and the engine's end reads it back into the request that its
sampler reads (`GenerationRequest.params`). `test_remote` walks the same fields to a
remote backend.
"""

import asyncio
import contextlib
from dataclasses import fields, replace
from typing import Any

from starlette.testclient import TestClient

from mlxserve.channel.messages import Generate, decode_front, encode
from mlxserve.channel.request import GenerationParams, Reasoning, SamplingParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.process.socket_end import to_request
from mlxserve.server.app import create_app
from mlxserve.server.backends.local import LocalEngine
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend

PROMPT = [10, 11, 12, 13]
COMPLETION = {"model": "demo", "prompt": PROMPT, "max_tokens": 4}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}

#: field: (the body's change, the value the record must then hold)
SAMPLING: dict[str, tuple[dict[str, Any], object]] = {
    "temperature": ({"temperature": 0.7}, 0.7),
    "top_p": ({"top_p": 0.9}, 0.9),
    "seed": ({"seed": -1}, (1 << 63) - 1),  # taken into [0, 2^63)
    "top_k": ({"top_k": 7}, 7),
    "min_p": ({"min_p": 0.05}, 0.05),
    "presence_penalty": ({"presence_penalty": 0.5}, 0.5),
    "frequency_penalty": ({"frequency_penalty": -0.25}, -0.25),
    "repetition_penalty": ({"repetition_penalty": 1.2}, 1.2),
    "logit_bias": ({"logit_bias": {"11": 2.5, "12": -100}}, ((11, 2.5), (12, -100.0))),
    "logprobs": ({"logprobs": 2}, 2),
}
PARAMS: dict[str, tuple[dict[str, Any], object]] = {
    "prompt_ids": ({"prompt": [20, 21]}, (20, 21)),
    "max_tokens": ({"max_tokens": 7}, 7),
    "stop_token_ids": ({"ignore_eos": True}, ()),
}
#: Not a completion's: the grammar comes with chat's response_format, the grammar
#: prefix with a resume (the router's, after a backend failed), the reasoning with a
#: chat prompt that opens one.
ELSEWHERE = {"sampling", "grammar", "grammar_prefix", "reasoning"}


#: Every field a generation's record holds, its sampling's included.
SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
ALL_FIELDS = {f.name for f in fields(GenerationParams)} - {"sampling"} | SAMPLING_FIELDS


def field_of(params: GenerationParams, name: str) -> object:
    """The field ``name`` of ``params``: its own, or its sampling's."""
    return getattr(params.sampling if name in SAMPLING_FIELDS else params, name)


def with_field(params: GenerationParams, name: str, value: object) -> GenerationParams:
    """``params`` with its field ``name`` (its own, or its sampling's) set to ``value``."""
    if name in SAMPLING_FIELDS:
        return replace(params, sampling=replace(params.sampling, **{name: value}))
    return replace(params, **{name: value})


def test_every_field_is_walked() -> None:
    assert set(SAMPLING) | set(PARAMS) | ELSEWHERE == ALL_FIELDS | {"sampling"}


def engine_request(params: GenerationParams, vocab_size: int) -> GenerationRequest:
    """``params`` through a `LocalEngine` (what it writes to the engine's socket) and the
    engine's end of it (what it submits to the engine)."""
    engine = LocalEngine("walk", env={}, startup_timeout_s=1, request_timeout_s=1)
    sent: list[Generate] = []
    engine._send = sent.append  # type: ignore[assignment,method-assign]

    async def send() -> None:
        stream = engine.generate("walk", params)
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # written; now waiting for the engine's tokens
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    asyncio.run(send())
    message = decode_front(encode(sent[0]))
    assert isinstance(message, Generate)
    return to_request(message, vocab_size)


def assert_reaches_the_sampler(params: GenerationParams, vocab_size: int) -> None:
    """The engine's request holds ``params`` as the front built them: its sampler reads
    ``request.params.sampling``, its chooser the grammar and its prefix."""
    assert engine_request(params, vocab_size).params == params


def calls(tokenizer: FrontTokenizer, path: str, bodies: list[dict[str, Any]]) -> list[Any]:
    """What the router handed a backend for each body, in order."""
    fake = FakeBackend("primary")
    with TestClient(create_app(make_runtime(tokenizer, [fake.up()]))) as client:
        for body in bodies:
            response = client.post(path, json=body)
            assert response.status_code == 200, response.text
    assert len(fake.calls) == len(bodies)
    return fake.calls


def test_every_completion_field_reaches_the_sampler(tokenizer: FrontTokenizer) -> None:
    walked = {**PARAMS, **SAMPLING}
    bodies = [COMPLETION] + [{**COMPLETION, **change} for change, _ in walked.values()]
    base, *got = calls(tokenizer, "/v1/completions", bodies)
    # What the body leaves out: OpenAI's defaults, the model's EOS (the fake's 5).
    assert base == GenerationParams(tuple(PROMPT), 4, SamplingParams(temperature=1.0), (5,))
    for (name, (_, value)), params in zip(walked.items(), got, strict=True):
        assert field_of(base, name) != value, f"{name}: the sample is the baseline's value"
        assert params == with_field(base, name, value), name
    for params in [base, *got]:
        assert_reaches_the_sampler(params, tokenizer.vocab_size)


def test_the_grammar_and_its_prefix_reach_the_sampler(tokenizer: FrontTokenizer) -> None:
    base, constrained = calls(
        tokenizer, "/v1/chat/completions", [CHAT, {**CHAT, "response_format": SCHEMA}]
    )
    assert base.grammar is None and constrained.grammar is not None
    assert constrained == replace(base, grammar=constrained.grammar)
    assert_reaches_the_sampler(constrained, tokenizer.vocab_size)

    primary = FakeBackend("primary", fail_after=2)
    standby = FakeBackend("standby")
    runtime = make_runtime(tokenizer, [primary.up(), standby.up()])
    with TestClient(create_app(runtime)) as client:
        body = {**CHAT, "response_format": SCHEMA}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    first, resumed = primary.calls[0], standby.calls[0]
    sent = resumed.prompt_ids[len(first.prompt_ids) :]
    assert len(sent) == 2 and first.grammar_prefix == ()
    assert resumed == replace(
        first, prompt_ids=first.prompt_ids + sent, max_tokens=2, grammar_prefix=sent
    )
    assert_reaches_the_sampler(resumed, tokenizer.vocab_size)


def test_the_reasoning_reaches_the_sampler(dsv4_tokenizer: FrontTokenizer) -> None:
    """A thinking budget, and a grammar after the reasoning: the reasoning's end marker
    (as the tokenizer's ids) and its budget reach the sampler; a free answer without a
    budget needs none."""
    end = tuple(dsv4_tokenizer.text_ids("</think>"))
    budget = {"type": "enabled", "budget_tokens": 9}
    base, bounded, constrained = calls(
        dsv4_tokenizer,
        "/v1/chat/completions",
        [CHAT, {**CHAT, "thinking": budget}, {**CHAT, "response_format": SCHEMA, "max_tokens": 8}],
    )
    assert base.reasoning is None and base.grammar is None
    assert bounded == replace(base, reasoning=Reasoning(end, 9))
    assert constrained.reasoning == Reasoning(end, None) and constrained.grammar is not None
    for params in (bounded, constrained):
        assert_reaches_the_sampler(params, dsv4_tokenizer.vocab_size)
