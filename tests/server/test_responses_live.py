"""The OpenAI Responses API with the `openai` client's ``responses.create`` against a
live server: text whole and streamed (its event sequence), function calls (forced
by a grammar on the demo) and their outputs in the next input, JSON output."""

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0) as client:
        yield client


def test_text_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.responses.create(
        model=MODEL,
        input="Python reference: for",
        instructions="Be brief.",
        max_output_tokens=16,
        temperature=0,
    )
    assert whole.output_text and whole.status in ("completed", "incomplete")
    assert whole.usage is not None and 0 < whole.usage.output_tokens <= 16
    events = list(
        client.responses.create(
            model=MODEL,
            input="Python reference: for",
            instructions="Be brief.",
            max_output_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text


def test_function_call_and_its_output(client: openai.OpenAI) -> None:
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.responses.create(
        model=MODEL,
        input=asked,  # type: ignore[arg-type]
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
    )
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    streamed = list(
        client.responses.create(
            model=MODEL,
            input=asked,  # type: ignore[arg-type]
            tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            stream=True,
        )
    )
    arguments = "".join(
        e.delta for e in streamed if e.type == "response.function_call_arguments.delta"
    )
    assert set(json.loads(arguments.split("}{")[0] + ("}" if "}{" in arguments else ""))) == {
        "city"
    }
    following = client.responses.create(
        model=MODEL,
        input=[
            *asked,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],  # type: ignore[arg-type]
        tools=[TOOL],
        max_output_tokens=8,
    )
    assert following.status in ("completed", "incomplete")


def test_json_output_and_refusals(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model=MODEL,
        input="Give JSON",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
    )
    assert isinstance(json.loads(reply.output_text), dict)
    for extra, param in [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort"),  # the template has no levels
        ({"reasoning": {"budget_tokens": 9}}, "reasoning.budget_tokens"),  # nor thinking
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="x", extra_body=extra)
        assert caught.value.body["param"] == param  # type: ignore[index]
