"""The API's chat request handed to the chat formats (`mlxserve.chat`), and its prompt.

Every API ends as a `ChatCompletionRequest` (`routes.chat_call`). Here it becomes the
formats' own `ChatRequest`, the model's format builds the prompt, a refusal becomes
a 400 naming the field, and a forced tool call becomes its grammar, checked against
the tokenizer before the request is admitted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mlxserve.chat import (
    Call,
    ChatPrompt,
    ChatRequest,
    Encode,
    Function,
    Message,
    NamedTool,
    Refused,
    TemplateKwargs,
    build_prompt,
)
from mlxserve.server.constraints import after_reasoning, forced_tool_grammar
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from mlxserve.server.tokenizer import FrontTokenizer


def chat_request(body: ChatCompletionRequest) -> ChatRequest:
    """What the formats read of ``body``: the conversation, the tools, the controls."""
    choice = body.tool_choice
    kwargs = body.chat_template_kwargs
    return ChatRequest(
        messages=tuple(
            Message(
                message.role,
                message.text(),
                name=message.name,
                reasoning_content=message.reasoning_content,
                tool_calls=tuple(
                    Call(call.id, call.function.name, call.function.arguments)
                    for call in message.tool_calls or []
                ),
                tool_call_id=message.tool_call_id,
                parts=None
                if message.content is None or isinstance(message.content, str)
                else tuple(part.text for part in message.content),
            )
            for message in body.messages
        ),
        tools=tuple(
            Function(function.name, function.description, function.parameters, function.strict)
            for function in (tool.function for tool in body.tools or [])
        ),
        tool_choice=(
            NamedTool(choice.function.name)
            if isinstance(choice, NamedToolChoice)
            else (choice or "auto")
        ),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=None if body.response_format is None else body.response_format.type,
        response_schema=_response_schema(body),
        thinking=None if body.thinking is None else body.thinking.type == "enabled",
        thinking_budget=None if body.thinking is None else body.thinking.budget_tokens,
        reasoning_effort=body.reasoning_effort,
        chat_template_kwargs=None
        if kwargs is None
        else TemplateKwargs(kwargs.thinking, kwargs.enable_thinking, kwargs.drop_thinking),
    )


def _response_schema(body: ChatCompletionRequest) -> dict[str, Any] | None:
    fmt = body.response_format
    if fmt is None or fmt.type != "json_schema" or fmt.json_schema is None:
        return None
    return fmt.json_schema.schema_


def chat_prompt(
    body: ChatCompletionRequest,
    tokenizer: FrontTokenizer,
    default_thinking: bool | None,
    encode: Encode | None = None,
) -> ChatPrompt:
    """The prompt of ``body`` (`mlxserve.chat.build_prompt`), with a forced call's grammar."""
    try:
        prompt = build_prompt(chat_request(body), tokenizer, default_thinking, encode)
    except Refused as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None
    forced = prompt.forced
    if forced is None:
        return prompt
    grammar = forced_tool_grammar(forced.style, forced.tools, forced.parallel, tokenizer)
    if prompt.reasoning_end is not None:
        grammar = after_reasoning(grammar, prompt.reasoning_end, tokenizer, "tools")
    return replace(prompt, grammar=grammar)
