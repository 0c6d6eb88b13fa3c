"""The Anthropic Messages API with the official `anthropic` client against a live
server: text, stop sequences, streaming events, forced tool use (a grammar on the
demo), tool results in the history, count_tokens, errors in Anthropic's shape.
x-api-key auth and thinking blocks are in ``test_deepseek_format_live.py``."""

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

ASK: list[Any] = [{"role": "user", "content": "Python reference: for"}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


def prompt_of(usage: anthropic.types.Usage) -> int:
    """The prompt's length: Anthropic's input_tokens leave out the cache's hits."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0) as client:
        yield client


def test_text_whole_streamed_and_stop_sequences(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(
        model=MODEL, max_tokens=16, messages=ASK, extra_body={"temperature": 0}, system="Be brief."
    )
    [block] = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 16
    with client.messages.stream(
        model=MODEL, max_tokens=16, messages=ASK, extra_body={"temperature": 0}, system="Be brief."
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == block.text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(kinds)
    assert kinds[-2] == "message_delta" and final.usage.output_tokens == whole.usage.output_tokens
    stop = block.text.strip()[2:5]
    cut = client.messages.create(
        model=MODEL,
        max_tokens=16,
        messages=ASK,
        extra_body={"temperature": 0},
        system="Be brief.",
        stop_sequences=[stop],
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert stop not in cut.content[0].text  # type: ignore[union-attr]
    count = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    assert count.input_tokens == prompt_of(whole.usage)


def test_forced_tool_use_whole_streamed_and_its_result(client: anthropic.Anthropic) -> None:
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.messages.create(
        model=MODEL,
        max_tokens=80,
        messages=asked,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert reply.stop_reason == "tool_use"
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city", "unit"}  # type: ignore[arg-type]
    with client.messages.stream(
        model=MODEL,
        max_tokens=80,
        messages=asked,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and all(u.input["unit"] in ("c", "f") for u in uses)  # type: ignore[index]
    history = [
        *asked,
        {"role": "assistant", "content": [use.model_dump()]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
        },
    ]
    after = client.messages.create(
        model=MODEL,
        max_tokens=8,
        messages=history,
        tools=[WEATHER],  # type: ignore[arg-type, list-item]
    )
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    assert counted.input_tokens == prompt_of(after.usage)


def test_errors_in_anthropic_shape(client: anthropic.Anthropic, live: LiveServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK, extra_body={"frob": 1})
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "frob" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=4, messages=ASK)
    with live.client() as http:
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": ""},
        }
        bad = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [image]}]}
        response = http.post("/v1/messages", json=bad)
        assert response.status_code == 400 and response.json()["type"] == "error"
        response = http.post("/v1/messages", json={"model": MODEL, "messages": ASK})
        assert response.status_code == 400 and "max_tokens" in json.dumps(response.json())


def test_output_config_format_is_enforced(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {
            "mood": {"enum": ["good", "bad"]},
            "note": {"type": "string", "maxLength": 20},
        },
        "required": ["mood", "note"],
        "additionalProperties": False,
    }
    reply = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    value = json.loads(reply.content[0].text)  # type: ignore[union-attr]
    assert value["mood"] in ("good", "bad") and len(value["note"]) <= 20


def test_usage_counts_a_cache_hit_once(client: anthropic.Anthropic) -> None:
    """input_tokens exclude the prompt's cached tokens, as Anthropic's do; the cache
    fields are numbers (0), never null, whole and streamed."""
    words = " ".join(f"item{i}" for i in range(40))
    asked: list[Any] = [{"role": "user", "content": f"List: {words}"}]
    prompt = client.messages.count_tokens(model=MODEL, messages=asked).input_tokens
    first = client.messages.create(model=MODEL, max_tokens=2, messages=asked)
    again = client.messages.create(model=MODEL, max_tokens=2, messages=asked)
    with client.messages.stream(model=MODEL, max_tokens=2, messages=asked) as stream:
        events = list(stream)
        streamed = stream.get_final_message().usage
    [start] = [e.message.usage for e in events if e.type == "message_start"]
    [end] = [e.usage for e in events if e.type == "message_delta"]
    delta = (end.input_tokens, end.cache_read_input_tokens, end.cache_creation_input_tokens)
    assert delta == (streamed.input_tokens, streamed.cache_read_input_tokens, 0)
    for usage in (first.usage, again.usage, streamed):
        assert usage.cache_creation_input_tokens == 0, usage
        assert usage.cache_read_input_tokens is not None, usage
        assert usage.input_tokens + usage.cache_read_input_tokens == prompt, usage
    # The same prompt again is a prefix-cache hit: counted once, as read from the cache.
    assert again.usage.cache_read_input_tokens and streamed.cache_read_input_tokens
    # message_start is sent before the hits are known: the whole prompt, nothing read.
    assert (start.input_tokens, start.cache_read_input_tokens) == (prompt, 0)
    assert start.cache_creation_input_tokens == 0
