"""Tools, structured output, logprobs, n and penalties: the `openai` client against a
live server (real front, real engine process, real llguidance masks on the logits).

The demo model never calls tools or writes JSON by itself: everything it writes
here that parses is the grammar's doing, which is the point.
"""

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def valid_weather(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "unit"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 16
    assert value["unit"] in ("c", "f")


def test_required_tool_call_parses_and_validates(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
    if call.function.name == "get_weather":  # type: ignore[union-attr]
        valid_weather(call.function.arguments)  # type: ignore[union-attr]


def test_named_tool_call_streams_and_round_trips(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for call in calls:
        valid_weather(call.function.arguments)
    # The call and its result go back through the template for the next turn.
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in calls),
    ]
    again = client.chat.completions.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=8,
    )
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_object_and_strict_schema(client: openai.OpenAI) -> None:
    obj = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=80,
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 30},
            "ok": {"type": "boolean"},
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["answer", "ok", "level"],
        "additionalProperties": False,
    }
    shaped = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": schema, "strict": True},
        },
        max_tokens=80,
        temperature=0.8,
        seed=7,
    )
    value = json.loads(shaped.choices[0].message.content or "")
    assert set(value) == {"answer", "ok", "level"}
    assert isinstance(value["answer"], str) and len(value["answer"]) <= 30
    assert isinstance(value["ok"], bool) and value["level"] in (1, 2, 3)


def test_strict_is_openai_s(client: openai.OpenAI) -> None:
    """strict: true takes OpenAI's strict schemas only (a 400 naming the part), and a
    strict call's arguments follow its schema."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[strict],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    [call] = response.choices[0].message.tool_calls or []
    valid_weather(call.function.arguments)  # type: ignore[union-attr]
    parameters = {**WEATHER["function"]["parameters"], "required": ["city"]}  # type: ignore[index]
    optional = {"type": "function", "function": {**strict["function"], "parameters": parameters}}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    strict_format = {"name": "reply", "schema": schema, "strict": True}
    for extra, param in [
        (
            {"tools": [optional], "tool_choice": "required"},
            "tools.0.function.parameters.properties.unit",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": strict_format}},
            "response_format.json_schema.schema",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL,
                messages=ASK,  # type: ignore[arg-type]
                max_tokens=4,
                extra_body=extra,
            )
        assert caught.value.body["param"] == param  # type: ignore[index]
        assert "strict" in caught.value.body["message"]  # type: ignore[index]


def test_logprobs_whole_and_streamed(client: openai.OpenAI) -> None:
    params: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = client.chat.completions.create(**params)
    content = whole.choices[0].logprobs.content or []  # type: ignore[union-attr]
    assert len(content) == whole.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(**params, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    completion = client.completions.create(
        model=MODEL, prompt="The assert statement", max_tokens=4, logprobs=2, temperature=0
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 4
    assert "".join(logprobs.tokens or []) == completion.choices[0].text


def test_n_choices_share_the_prompt_and_penalties_apply(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=8,
        n=3,
        temperature=0.9,
        seed=11,
        # top_k: the choices have a TokenChooser (they batch and speculate like others).
        # Without it (plain sampled choices) the cached_tokens check below fails on main
        # too, reported to the lead; not this test's subject.
        extra_body={"top_k": 50},
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    usage = response.usage
    assert usage is not None and usage.completion_tokens <= 24
    # choices 1 and 2 start after choice 0's prompt is in the prefix cache
    assert usage.prompt_tokens_details and usage.prompt_tokens_details.cached_tokens
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=4,
        n=2,
        stream=True,
        extra_body={"top_k": 50},
    )
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_logit_bias_and_penalties_change_the_choice(
    client: openai.OpenAI, live: LiveServer
) -> None:
    with live.client() as http:
        tokenize = {"model": MODEL, "prompt": "The assert statement"}
        prompt = [int(t) for t in http.post("/tokenize", json=tokenize).json()["tokens"]]
        greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        tokenize = {"model": MODEL, "prompt": greedy.choices[0].text}
        [first] = http.post("/tokenize", json=tokenize).json()["tokens"]
    banned = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=1,
        temperature=0,
        logit_bias={str(first): -100},
    )
    assert banned.choices[0].text != greedy.choices[0].text
    shaped = client.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0.7,
        seed=3,
        extra_body={"repetition_penalty": 1.3, "top_k": 5, "min_p": 0.05},
        frequency_penalty=1.5,
        presence_penalty=1.0,
    )
    assert shaped.choices[0].message.content  # an answer under every transform


def test_unsupported_fields_are_refused_by_name(client: openai.OpenAI) -> None:
    for extra, param in [
        ({"audio": {"voice": "x"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [TIME]},
            "tool_choice.function.name",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                max_tokens=2,
                extra_body=extra,  # type: ignore[arg-type]
            )
        assert caught.value.body["param"] == param  # type: ignore[index]


#: A schema with no finite value: llguidance compiles it, then fails at the first mask.
RECURSIVE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}


def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_it(live: LiveServer) -> None:
    """Refused before admission (a bad request, not an outage: never 503, never retried),
    and the engine goes on serving."""
    recursive_tool = {"type": "function", "function": {"name": "f", "parameters": RECURSIVE}}
    for extra, param in [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": RECURSIVE},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {"tools": [TIME, recursive_tool], "tool_choice": "required"},
            "tools.1.function.parameters",
        ),
        (
            {
                "tools": [TIME, recursive_tool],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tools.1.function.parameters",
        ),
    ]:
        with live.client() as http:
            body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
            response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["code"] == "invalid_value"
    with live.client() as http:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
