"""The request bodies benchmark tools and SDKs really send, replayed through a live server.

Each fixture in ``fixtures/tool_requests/`` is one body a tool sent (GuideLLM, aiperf,
openai-agents, LangChain's ChatOpenAI, LiteLLM), captured from the tool itself by
``benchmarks/guidellm/capture.py``, or one ``vllm bench serve`` builds (read from its
source: vLLM is not installable here); each names the tool, its version and how it
was captured. Why: a field a tool sends and mlxserve refuses makes the tool fail on
every request (issue 33: GuideLLM's ``continuous_usage_stats``), so the support must
not quietly regress. Answers are checked with the ``openai`` package's own types,
and streamed usage as vLLM sends it (each chunk, when asked for continuously).
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from tests.server.live import MODEL, LiveServer

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).parent / "fixtures" / "tool_requests"
#: Tokens asked of the model per replay: the tools' own counts (up to a few hundred)
#: would make the suite slow for nothing the check needs.
MAX_TOKENS = 8
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
RESPONSES = "/v1/responses"


def fixture_files() -> list[Path]:
    return sorted(FIXTURES.glob("*.json"))


def replayed(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The captured body, served by the live model, with a short answer."""
    out = {**body, "model": MODEL}
    for field in TOKEN_FIELDS:
        if field in out:
            out[field] = min(int(out[field]), MAX_TOKENS)
    if not any(field in out for field in TOKEN_FIELDS):  # a default would be the whole context
        out["max_output_tokens" if path == RESPONSES else "max_tokens"] = MAX_TOKENS
    return out


def events(text: str) -> list[str]:
    data = [line[len("data:") :].strip() for line in text.splitlines() if line.startswith("data:")]
    assert data and data[-1] == "[DONE]", text[-500:]
    return data[:-1]


def check_responses_stream(text: str) -> None:
    """The Responses API's typed events: no [DONE]; the last is the whole response."""
    data = [
        json.loads(line[len("data:") :]) for line in text.splitlines() if line.startswith("data:")
    ]
    assert data and data[0]["type"] == "response.created", text[:500]
    assert data[-1]["type"] in ("response.completed", "response.incomplete"), data[-1]
    Response.model_validate(data[-1]["response"])


class _Chunk:
    """A streamed completion chunk read as the checks below read chat chunks."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.choices = [_Choice(choice) for choice in data["choices"]]
        usage = data.get("usage")
        self.usage = None if usage is None else CompletionUsage.model_validate(usage)


class _Choice:
    def __init__(self, data: dict[str, Any]) -> None:
        self.finish_reason = data.get("finish_reason")


def check_stream(path: str, body: dict[str, Any], text: str) -> None:
    if path == RESPONSES:
        check_responses_stream(text)
        return
    chunks = [json.loads(item) for item in events(text)]
    assert not any("error" in chunk for chunk in chunks), chunks
    if path.endswith("chat/completions"):
        parsed: list[Any] = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks]
    else:  # the SDK's Completion type wants a finish reason OpenAI's own chunks leave null
        for chunk in chunks:
            assert chunk["object"] == "text_completion"
            assert all(isinstance(choice["text"], str) for choice in chunk["choices"])
        parsed = [_Chunk(chunk) for chunk in chunks]
    options = body.get("stream_options") or {}
    finished = [c for c in parsed if c.choices and c.choices[0].finish_reason is not None]
    assert len(finished) == 1
    if not options.get("include_usage"):
        assert all(c.usage is None for c in parsed)
        return
    last = parsed[-1]
    assert not last.choices and last.usage is not None
    assert last.usage.completion_tokens > 0
    if options.get("continuous_usage_stats"):  # vLLM's shape: every chunk, counts so far
        counts = [c.usage.completion_tokens for c in parsed if c.usage is not None]
        assert len(counts) == len(parsed)
        assert counts == sorted(counts) and counts[-1] == last.usage.completion_tokens
        assert all(
            c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
            for c in parsed
            if c.usage is not None
        )


def check_answer(path: str, answer: dict[str, Any]) -> None:
    if path == RESPONSES:
        response = Response.model_validate(answer)
        assert response.status in ("completed", "incomplete") and response.usage is not None
    elif path.endswith("chat/completions"):
        chat = ChatCompletion.model_validate(answer)
        assert chat.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert chat.usage is not None and chat.usage.completion_tokens > 0
    else:
        completion = Completion.model_validate(answer)
        assert completion.choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with live.client() as client:
        yield client


def test_every_surveyed_tool_has_fixtures() -> None:
    tools = {json.loads(path.read_text())["tool"] for path in fixture_files()}
    assert {"guidellm", "aiperf", "vllm bench serve", "openai-agents"} <= tools
    assert {"langchain-openai", "litellm"} <= tools


@pytest.mark.parametrize("path", fixture_files(), ids=lambda path: path.stem)
def test_replay(http: httpx.Client, path: Path) -> None:
    fixture = json.loads(path.read_text())
    assert fixture["tool"] and fixture["version"] and fixture["captured"]
    body = replayed(fixture["path"], fixture["body"])
    response = http.post(fixture["path"], json=body)
    expect = fixture.get("expect")
    if expect is not None:  # a field refused on purpose (docs/compatibility.md says why)
        assert response.status_code == expect["status"], response.text
        assert response.json()["error"]["param"] == expect["param"]
        return
    assert response.status_code == 200, response.text
    if body.get("stream"):
        check_stream(fixture["path"], body, response.text)
    else:
        check_answer(fixture["path"], response.json())
