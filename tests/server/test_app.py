"""The HTTP surface with fake backends: routes, error rows, status codes and shapes."""

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from mlxserve.server.app import create_app
from mlxserve.server.tokenizer import FrontTokenizer
from tests.server.conftest import make_runtime
from tests.server.fakes import FakeBackend, greedy

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
USER = {"role": "user", "content": "Hello"}
PART = {"type": "text", "text": "Hello"}
IMAGE = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
REFUSED = {"role": "assistant", "content": "x", "refusal": "no"}
OBFUSCATION = "stream_options.include_obfuscation"


def with_message(message: dict[str, Any]) -> dict[str, Any]:
    return {**CHAT, "messages": [message]}


def with_function(**function: Any) -> dict[str, Any]:
    return {**CHAT, "tools": [{"type": "function", "function": {"name": "f", **function}}]}


def with_parts(*parts: dict[str, Any]) -> dict[str, Any]:
    return with_message({"role": "user", "content": list(parts)})


def assert_error(response, status: int, param: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param
    return error  # type: ignore[no-any-return]


def test_health_and_ready(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    ready = client.get("/ready")
    assert ready.status_code == 200
    assert ready.json()["active"] == "primary"


def test_models_and_policy(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["demo"]
    assert client.get("/v1/models/demo").json()["id"] == "demo"
    assert_error(client.get("/v1/models/gpt-4"), 404, "model")
    assert client.get("/v1/policy").json()["plan_hash"] == "abc123"


def test_chat_completion(client: TestClient, tokenizer: FrontTokenizer, fake: FakeBackend) -> None:
    response = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0})
    assert response.status_code == 200
    body = response.json()
    assert response.headers["x-mlxserve-backend"] == "primary"
    prompt = tokenizer.chat_ids([{"role": "user", "content": "Hello"}])
    assert list(fake.calls[0].prompt_ids) == prompt
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(greedy(prompt, 4))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 4,
        "total_tokens": len(prompt) + 4,
    }


def test_stream_with_usage(client: TestClient) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_completions_token_prompt(client: TestClient, fake: FakeBackend) -> None:
    response = client.post("/v1/completions", json={"model": "demo", "prompt": [10, 11, 12]})
    assert response.status_code == 200
    assert list(fake.calls[0].prompt_ids) == [10, 11, 12]
    assert fake.calls[0].max_tokens == 16  # OpenAI's default for completions


def test_echoed_fields_mlxserve_never_fills_are_accepted_empty(
    client: TestClient, fake: FakeBackend
) -> None:
    """An assistant message sent back as the client got it: its empty extras pass."""
    call = {
        "id": "c1",
        "type": "function",
        "index": 0,
        "function": {"name": "f", "arguments": "{}"},
    }
    echoed = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "tool_calls": [call],
    }
    # OpenAI's cookbook names the function on the tool message, too
    result = {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "ok"}
    messages = [USER, echoed, result]
    function = {"name": "f", "parameters": {"type": "object"}, "strict": False}
    tools = [{"type": "function", "function": function}]
    parts = [{**PART, "cache_control": {"type": "ephemeral"}}]
    body = {**CHAT, "messages": [*messages, {"role": "user", "content": parts}], "tools": tools}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    # A history ending with the assistant's turn is counted, never continued.
    ended = {"model": "demo", "messages": [USER, {"role": "assistant", "content": "Hi"}]}
    assert client.post("/tokenize", json=ended).status_code == 200
    assert client.post("/v1/chat/completions", json=ended).status_code == 400
    block = {"type": "text", "text": "Hi", "citations": [], "cache_control": {"type": "ephemeral"}}
    anthropic = {**ANTHROPIC, "messages": [{"role": "user", "content": [block]}]}
    assert client.post("/v1/messages", json=anthropic).status_code == 200
    message = assert_anthropic_error(
        client.post("/v1/messages", json={**ANTHROPIC, "max_tokens": "5"}),
        400,
        "invalid_request_error",
    )
    assert message.startswith("max_tokens:"), message
    block = {"type": "text", "text": "Hi", "bogus": 1}
    bogus = {**ANTHROPIC, "messages": [{"role": "user", "content": [block]}]}
    message = assert_anthropic_error(
        client.post("/v1/messages", json=bogus), 400, "invalid_request_error"
    )
    assert message.startswith("messages.0.content.0.bogus:"), message


def test_a_completion_keeps_the_space_its_first_token_starts_with(
    client: TestClient, tokenizer: FrontTokenizer, fake: FakeBackend
) -> None:
    """The text goes on from the prompt: prompt + text is the whole, and it matches
    the tokens' offsets. A chat reply starts a turn and reads without that space."""
    words = tokenizer.text_ids(" is not")
    assert tokenizer.decode(words[:1]).startswith(" ") or tokenizer.decode(words).startswith(" ")
    fake.script = words
    response = client.post(
        "/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 3}
    )
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert text.startswith(" is not"), text
    streamed = tokenizer.continuation_detokenizer()
    plain = tokenizer.detokenizer()
    for token in words:
        streamed.add_token(token)
        plain.add_token(token)
    streamed.finalize()
    plain.finalize()
    assert streamed.last_segment == " is not"
    assert plain.last_segment == "is not"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "n": 9}, "n"),
        ({**CHAT, "frobnicate": 1}, "frobnicate"),
        ({**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "logit_bias": {"5000": 1}}, "logit_bias"),
        ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
        ({**CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
        ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({**CHAT, "tool_choice": "required"}, "tool_choice"),
        ({**CHAT, "temperature": 3}, "temperature"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "top_p": 0}, "top_p"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({**CHAT, "stop": ["a"] * 17}, "stop"),
        ({"messages": CHAT["messages"]}, "model"),
        ({**CHAT, "max_tokens": 300}, "max_tokens"),  # prompt + max_tokens > context 256
        ({**CHAT, "max_completion_tokens": 300}, "max_completion_tokens"),
        # inside messages, content parts and tools too: nothing is dropped in silence
        (with_message({**USER, "bogus": 1}), "messages.0.bogus"),
        (with_parts({**PART, "bogus": 1}), "messages.0.content.0.bogus"),
        (with_parts(IMAGE), "messages.0.content.0.type"),
        (with_message({**USER, "reasoning_content": "hm"}), "messages.0.reasoning_content"),
        (with_message({**USER, "tool_call_id": "c1"}), "messages.0.tool_call_id"),
        ({**CHAT, "messages": [USER, REFUSED]}, "messages.1.refusal"),
        (with_function(bogus=1), "tools.0.function.bogus"),
        ({**CHAT, "Temperature": 0.2}, "Temperature"),  # a client's key, named as sent
        (with_function(strict=True), "tools.0.function.strict"),  # unkept without a forced call
        ({**CHAT, "stream_options": {"include_obfuscation": True}}, OBFUSCATION),
        ({**CHAT, "stream_options": {"Include_usage": True}}, "stream_options.Include_usage"),
        ({**CHAT, "tools": with_function()["tools"] * 2}, "tools.1.function.name"),
        ({**CHAT, "messages": [USER, {"role": "assistant", "content": "4 5"}]}, "messages.1.role"),
        ({**CHAT, "tool_choice": "always"}, "tool_choice"),
        # no coercion: a string is not a flag or a count, nor a flag a number
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "n": "2"}, "n"),
        ({**CHAT, "max_tokens": True}, "max_tokens"),
        ({**CHAT, "temperature": "0.5"}, "temperature"),
        ({**CHAT, "stream": True, "stream_options": {"bogus": 1}}, "stream_options.bogus"),
    ],
)  # fmt: skip
def test_invalid_chat_fields_are_400(
    client: TestClient, fake: FakeBackend, body: dict, param: str
) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert fake.calls == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "demo"}, "prompt"),
        ({"model": "demo", "prompt": []}, "prompt"),
        ({"model": "demo", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "demo", "prompt": [1, 5000]}, "prompt"),
        ({"model": "demo", "prompt": "x", "echo": True}, "echo"),
        ({"model": "demo", "prompt": "x" * 300, "max_tokens": 1}, "prompt"),
    ],
)
def test_invalid_completion_fields_are_400(client: TestClient, body: dict, param: str) -> None:
    assert_error(client.post("/v1/completions", json=body), 400, param)


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"\xff\xfe", b"", b"null"])
def test_malformed_json_is_400(client: TestClient, raw: bytes) -> None:
    response = client.post(
        "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert assert_error(response, 400)["code"] == "invalid_json"


def test_unknown_model_is_404_and_never_reaches_a_backend(
    client: TestClient, fake: FakeBackend
) -> None:
    error = assert_error(
        client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, "model"
    )
    assert error["code"] == "model_not_found"
    assert fake.calls == []


TURNS = CHAT["messages"]
NO_NAME = {"type": "tool"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # Each body is also wrong in what it translates to: the model is judged first.
        ("/v1/messages", {**CHAT, "tool_choice": NO_NAME}),
        ("/v1/messages/count_tokens", {"model": "demo", "messages": TURNS, "tool_choice": NO_NAME}),
        ("/v1/responses", {"model": "demo", "input": []}),
        ("/tokenize", {"model": "demo", "messages": TURNS, "tool_choice": "required"}),
    ],
)  # fmt: skip
def test_every_chat_shaped_route_checks_the_model_before_the_content(
    client: TestClient, fake: FakeBackend, path: str, body: dict[str, Any]
) -> None:
    assert client.post(path, json=body).status_code == 400  # the content alone is wrong
    response = client.post(path, json={**body, "model": "gpt-4"})
    assert response.status_code == 404, response.text
    assert fake.calls == []


def test_body_over_the_limit_is_413(client: TestClient) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_error(client.post("/v1/chat/completions", json=big), 413)

    def chunked():  # type: ignore[no-untyped-def]
        yield json.dumps(big).encode()

    json_type = {"content-type": "application/json"}
    assert_error(client.post("/v1/chat/completions", content=chunked(), headers=json_type), 413)


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/chat/completions"), 405)


ANTHROPIC = {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}


def assert_anthropic_error(response, status: int, kind: str) -> str:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind
    return body["error"]["message"]  # type: ignore[no-any-return]


def test_anthropic_routes_answer_every_error_in_their_shape(
    client: TestClient, tokenizer: FrontTokenizer
) -> None:
    """Not only the route's own errors: the body limit's, Starlette's 404 and 405, a bug's."""
    big = {**ANTHROPIC, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_anthropic_error(client.post("/v1/messages", json=big), 413, "request_too_large")
    assert_anthropic_error(client.get("/v1/messages"), 405, "invalid_request_error")
    assert_anthropic_error(client.get("/v1/messages/count_tokens"), 405, "invalid_request_error")
    assert_anthropic_error(
        client.post("/v1/messages/nothing", json=ANTHROPIC), 404, "not_found_error"
    )
    buggy = FakeBackend("primary", crash=True)
    runtime = make_runtime(tokenizer, [buggy])
    buggy.up()
    with TestClient(create_app(runtime), raise_server_exceptions=False) as crashing:
        message = assert_anthropic_error(
            crashing.post("/v1/messages", json=ANTHROPIC), 500, "api_error"
        )
        assert message == "internal server error"


LONE = "\ud83d"  # a lone UTF-16 surrogate: json.dumps writes it as an escape, valid JSON
LONE_USER = [{"role": "user", "content": LONE}]
LONE_SYSTEM = [{"role": "system", "content": "a" + LONE}, *CHAT["messages"]]  # type: ignore[misc]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "messages": LONE_USER}, "messages.0.content"),
        ("/v1/chat/completions", {**CHAT, "messages": LONE_SYSTEM}, "messages.0.content"),
        ("/v1/completions", {"model": "demo", "prompt": LONE + "x", "max_tokens": 2}, "prompt"),
        ("/tokenize", {"model": "demo", "prompt": LONE}, "prompt"),
        ("/v1/responses", {"model": "demo", "input": LONE}, "input"),
    ],
)  # fmt: skip
def test_a_lone_surrogate_is_400_naming_its_field(
    client: TestClient, fake: FakeBackend, path: str, body: dict[str, Any], param: str
) -> None:
    raw = json.dumps(body).encode()
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert assert_error(response, 400, param)["code"] == "invalid_value"
    anthropic = {**ANTHROPIC, "messages": LONE_USER}
    raw = json.dumps(anthropic).encode()
    message = assert_anthropic_error(
        client.post("/v1/messages", content=raw, headers={"content-type": "application/json"}),
        400,
        "invalid_request_error",
    )
    assert message.startswith("messages.0.content:")
    assert fake.calls == []


def test_queue_full_is_429_with_retry_after(tokenizer: FrontTokenizer) -> None:
    slow = FakeBackend("primary", delay_s=0.2)
    runtime = make_runtime(tokenizer, [slow], max_queue=0)
    slow.up()
    with TestClient(create_app(runtime)) as client:
        # max_running is 2 and the queue holds none: a third concurrent request is refused.
        streams = [
            client.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50}
            )
            for _ in range(2)
        ]
        for stream in streams:
            stream.__enter__()
        response = client.post("/v1/chat/completions", json=CHAT)
        error = assert_error(response, 429)
        assert error["type"] == "rate_limit_error"
        assert response.headers["retry-after"] == "1"
        for stream in streams:
            stream.__exit__(None, None, None)


def test_no_healthy_backend_is_503_with_retry_after(tokenizer: FrontTokenizer) -> None:
    down = FakeBackend("primary")
    runtime = make_runtime(
        tokenizer, [down], retry_attempts=2, retry_backoff_s=0.01, restart_wait_s=0.1
    )
    down.up()
    down.fail()
    with TestClient(create_app(runtime)) as client:
        response = client.post("/v1/chat/completions", json=CHAT)
        assert_error(response, 503)
        assert response.headers["retry-after"] == "1"
        assert client.get("/ready").status_code == 503


def test_internal_error_is_500_without_internals(tokenizer: FrontTokenizer) -> None:
    buggy = FakeBackend("primary", crash=True)
    runtime = make_runtime(tokenizer, [buggy])
    buggy.up()
    with TestClient(create_app(runtime), raise_server_exceptions=False) as client:
        response = client.post("/v1/chat/completions", json=CHAT)
        error = assert_error(response, 500)
        assert error["message"] == "internal server error"
        assert "fake bug" not in response.text


def test_backend_rejection_is_502_and_not_retried(tokenizer: FrontTokenizer) -> None:
    picky = FakeBackend("primary", reject=True)
    runtime = make_runtime(tokenizer, [picky])
    picky.up()
    with TestClient(create_app(runtime)) as client:
        assert_error(client.post("/v1/chat/completions", json=CHAT), 502)
    assert len(picky.calls) == 1


def test_metrics_count_requests_and_tokens(client: TestClient) -> None:
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/chat/completions", json={**CHAT, "n": 9})
    text = client.get("/metrics").text
    assert 'mlxserve_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert 'mlxserve_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert "mlxserve_completion_tokens_total 4.0" in text
    assert "mlxserve_time_to_first_token_seconds_count 1.0" in text
    assert 'mlxserve_backend_healthy{backend="primary"} 1.0' in text
