"""The API's chat request as the chat formats read it, and a refusal as a 400."""

import pytest

from mlxserve.chat import Call, ChatRequest, Function, Message, NamedTool, TemplateKwargs
from mlxserve.server.chat_request import chat_prompt, chat_request
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import ChatCompletionRequest
from mlxserve.server.tokenizer import FrontTokenizer

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
FUNCTION = {"name": "f", "description": "F.", "parameters": {"type": "object"}, "strict": True}


def test_every_field_the_formats_read_arrives() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "S", "name": "ops"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "R",
                    "tool_calls": [CALL],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
            ],
            "tools": [{"type": "function", "function": FUNCTION}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False,
            "response_format": {"type": "text"},
            "thinking": {"type": "disabled"},
            "reasoning_effort": "max",
            "chat_template_kwargs": {
                "thinking": False,
                "enable_thinking": False,
                "drop_thinking": True,
            },
        }
    )
    assert chat_request(body) == ChatRequest(
        messages=(
            Message("system", "S", name="ops"),
            Message("user", "ab", parts=("a", "b")),
            Message(
                "assistant", "", reasoning_content="R", tool_calls=(Call("c1", "f", '{"a": 1}'),)
            ),
            Message("tool", "r", tool_call_id="c1"),
        ),
        tools=(Function("f", "F.", {"type": "object"}, strict=True),),
        tool_choice=NamedTool("f"),
        parallel_tool_calls=False,
        response_format="text",
        thinking=False,
        reasoning_effort="max",
        chat_template_kwargs=TemplateKwargs(False, False, True),
    )


def test_a_refusal_is_a_400_naming_the_field(tokenizer: FrontTokenizer) -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "max"}
    )
    with pytest.raises(InvalidRequest) as caught:
        chat_prompt(body, tokenizer, None)
    assert caught.value.param == "reasoning_effort"
    assert "only DeepSeek-V4's encoder has reasoning levels" in caught.value.message


def test_a_forced_call_gets_its_grammar(tokenizer: FrontTokenizer) -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
        }
    )
    prompt = chat_prompt(body, tokenizer, None)
    assert prompt.forced is not None and prompt.forced.style == "json_tools"
    assert prompt.grammar is not None and "<tool_call>" in prompt.grammar
