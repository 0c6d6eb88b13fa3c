"""Each surveyed SDK's basic chat request, streamed and not, against a running server.

    /work/toolsvenv/bin/python benchmarks/guidellm/sdk_survey.py \
        --base-url http://127.0.0.1:8000/v1 --model demo > survey.json

Runs in a virtual environment of its own holding the SDKs (``openai-agents``,
``langchain-openai``, ``litellm``; never the project's): what each sends is what a
user of that SDK sends. Point ``--base-url`` at ``capture.py`` to record the bodies.
Prints one JSON document: per SDK and call, ``ok`` and a short text or the error.
Why: issue 33's target is that every surveyed tool completes its basic chat request,
streamed and not, unchanged; this is the run that shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import traceback
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

PROMPT = "Python reference: the for statement."
#: Enough for the demo to end its answer greedily: openai-agents treats a Responses answer
#: cut by max_output_tokens (status "incomplete") as an error, as it would from OpenAI.
MAX_TOKENS = 128


def agents_calls(base_url: str, model: str) -> dict[str, Callable[[], Awaitable[str]]]:
    """openai-agents: an agent on the Chat Completions model and one on the Responses
    model (the SDK's default for OpenAI), each run plain and streamed, and an agent
    with a function tool."""
    from agents import (  # type: ignore[import-not-found, unused-ignore]
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the tracer would post to api.openai.com
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    settings = ModelSettings(max_tokens=MAX_TOKENS, temperature=0)

    @function_tool  # type: ignore[untyped-decorator, unused-ignore]
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    def agent(kind: str, tools: list[Any] | None = None) -> Any:
        chosen = (
            OpenAIChatCompletionsModel(model=model, openai_client=client)
            if kind == "chat"
            else OpenAIResponsesModel(model=model, openai_client=client)
        )
        return Agent(
            name="survey",
            instructions="Answer briefly.",
            model=chosen,
            model_settings=settings,
            tools=tools or [],
        )

    async def run(kind: str, tools: list[Any] | None = None) -> str:
        result = await Runner.run(agent(kind, tools), PROMPT, max_turns=1)
        return str(result.final_output)

    async def streamed(kind: str) -> str:
        result = Runner.run_streamed(agent(kind), PROMPT, max_turns=1)
        async for _ in result.stream_events():
            pass
        return str(result.final_output)

    return {
        "chat": lambda: run("chat"),
        "chat_stream": lambda: streamed("chat"),
        "responses": lambda: run("responses"),
        "responses_stream": lambda: streamed("responses"),
        "chat_with_tool": lambda: run("chat", [weather]),
    }


def langchain_calls(base_url: str, model: str) -> dict[str, Callable[[], Awaitable[str]]]:
    """LangChain's ChatOpenAI: invoke and stream, then the same on its Responses API."""
    from langchain_openai import ChatOpenAI  # type: ignore[import-not-found, unused-ignore]

    def chat(**extra: Any) -> Any:
        return ChatOpenAI(
            model=model,
            base_url=base_url,
            api_key="unused",
            max_tokens=MAX_TOKENS,
            max_retries=0,
            **extra,
        )

    async def invoke(**extra: Any) -> str:
        return str((await chat(**extra).ainvoke(PROMPT)).content)

    async def stream(**extra: Any) -> str:
        parts = [str(chunk.content) async for chunk in chat(**extra).astream(PROMPT)]
        return "".join(parts)

    return {
        "invoke": invoke,
        "stream": stream,
        "responses_invoke": lambda: invoke(use_responses_api=True),
        "responses_stream": lambda: stream(use_responses_api=True),
    }


def litellm_calls(base_url: str, model: str) -> dict[str, Callable[[], Awaitable[str]]]:
    """LiteLLM's ``acompletion`` through its ``openai/`` provider (any OpenAI-compatible
    server) and its ``hosted_vllm/`` provider (what vLLM users pick)."""
    import litellm  # type: ignore[import-not-found, unused-ignore]

    messages = [{"role": "user", "content": PROMPT}]

    async def call(provider: str, stream: bool) -> str:
        response = await litellm.acompletion(
            model=f"{provider}/{model}",
            api_base=base_url,
            api_key="unused",
            messages=messages,
            max_tokens=MAX_TOKENS,
            stream=stream,
        )
        if not stream:
            return str(response.choices[0].message.content)
        parts = [chunk.choices[0].delta.content or "" async for chunk in response]
        return "".join(parts)

    return {
        "openai": lambda: call("openai", False),
        "openai_stream": lambda: call("openai", True),
        "hosted_vllm": lambda: call("hosted_vllm", False),
        "hosted_vllm_stream": lambda: call("hosted_vllm", True),
    }


SDKS: dict[str, tuple[str, Callable[[str, str], dict[str, Callable[[], Awaitable[str]]]]]] = {
    "openai-agents": ("openai-agents", agents_calls),
    "langchain-openai": ("langchain-openai", langchain_calls),
    "litellm": ("litellm", litellm_calls),
}


async def survey(base_url: str, model: str, only: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {"base_url": base_url, "model": model, "sdks": {}}
    for name in only:
        package, make = SDKS[name]
        entry: dict[str, Any] = {"version": metadata.version(package), "calls": {}}
        for call, run in make(base_url, model).items():
            try:
                text = await asyncio.wait_for(run(), timeout=300)
                entry["calls"][call] = {"ok": True, "text": text[:80]}
            except Exception as exc:  # the report says what failed; the run goes on
                trace = traceback.format_exception_only(type(exc), exc)
                entry["calls"][call] = {"ok": False, "error": "".join(trace).strip()[:600]}
            print(f"{name} {call}: {entry['calls'][call]['ok']}", file=sys.stderr)
        report["sdks"][name] = entry
    report["all_ok"] = all(
        call["ok"] for entry in report["sdks"].values() for call in entry["calls"].values()
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the OpenAI base URL, ending in /v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--sdk", action="append", choices=sorted(SDKS), help="default: all")
    args = parser.parse_args()
    report = asyncio.run(survey(args.base_url, args.model, args.sdk or sorted(SDKS)))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
