"""The `openai` package against a live mlxserve (real front, real engine process)."""

from collections.abc import Iterator

import openai
import pytest

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Python reference: for"}]


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def chat_text(client: openai.OpenAI, **kwargs: object) -> openai.types.chat.ChatCompletion:
    params = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    return client.chat.completions.create(**{**params, **kwargs})  # type: ignore[no-any-return, call-overload]


def test_models(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]


def test_chat_and_usage(client: openai.OpenAI) -> None:
    response = chat_text(client)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None and usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_stream_equals_non_stream_greedy(client: openai.OpenAI) -> None:
    whole = chat_text(client)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="The for statement", max_tokens=8, temperature=0
    )
    assert response.choices[0].text
    assert response.usage is not None and response.usage.completion_tokens <= 8
    stream = client.completions.create(
        model=MODEL, prompt="The for statement", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == response.choices[0].text


def test_max_tokens(client: openai.OpenAI) -> None:
    response = chat_text(client, max_tokens=3)
    assert response.usage is not None and response.usage.completion_tokens <= 3
    if response.choices[0].finish_reason == "length":
        assert response.usage.completion_tokens == 3
    response = chat_text(client, max_tokens=None, max_completion_tokens=2)
    assert response.usage is not None and response.usage.completion_tokens <= 2


def test_stop_strings(client: openai.OpenAI) -> None:
    full = chat_text(client, max_tokens=32).choices[0].message.content or ""
    assert len(full) > 8, full
    stop = full[4:7]
    expected = full[: full.index(stop)]
    response = chat_text(client, max_tokens=32, stop=[stop])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"


def test_seed_determinism(client: openai.OpenAI) -> None:
    first = chat_text(client, temperature=1.0, seed=1234, max_tokens=16)
    second = chat_text(client, temperature=1.0, seed=1234, max_tokens=16)
    assert first.choices[0].message.content == second.choices[0].message.content


def test_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        chat_text(client, model="gpt-4")
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        chat_text(client, n=9)
    assert bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as too_long:
        chat_text(client, max_tokens=1_000_000)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        chat_text(client, temperature=-1)


def test_status_page_reflects_the_real_engine(client: openai.OpenAI, live: LiveServer) -> None:
    chat_text(client)
    with live.client() as http:
        data = http.get("/status", params={"format": "json"}).json()
        page = http.get("/status").text
    assert data["ready"] is True and data["active_backend"] == "primary"
    assert data["traffic"]["completion_tokens"] > 0
    (rank,) = data["plan"]["ranks"]  # this machine, one rank, as the engine planned it
    assert rank["decisions"]["nax_moe"]["value"] == "off"
    assert "nax_moe = <b>off</b>" in page
