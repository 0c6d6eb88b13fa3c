"""A chat request to its prompt: the controls every format shares, then the model's format.

Three prompt formats (`ChatTokenizer.prompt_format`): the model's chat template
(`template`); DeepSeek-V4's own encoder, for ``deepseek_v4`` and ``deepseek_v41``
models without a template (the published checkpoints ship none: `deepseek_v4.format`;
V4.1 in its own dialect, `deepseek_v4.dialect`); a plain transcript for base models.
The thinking and tool controls mean what each format can honour, and a control a
format cannot honour is refused by name rather than silently dropped (`Refused`):

- DeepSeek-V4 encoder: thinking on or off (default on, or ``[chat] thinking``),
  ``reasoning_effort`` (its levels low / high / max, each checkpoint's prompts:
  `deepseek_v4.format`), ``drop_thinking``, tools (DSML, in the checkpoint's dialect).
- A template whose vocabulary has ``<think>`` / ``</think>``: thinking on or off is
  passed to the template as ``enable_thinking``; no reasoning effort.
- A template with a tool-call format mlx-lm knows (``TokenizerWrapper.tool_parser``):
  tools go to the template, calls and tool results in the history too, and the
  answer is read with mlx-lm's parser (`MarkedToolParser`).
- Any other template, or the transcript: thinking can only be off; no tools.

Everywhere ``reasoning_effort`` "none" is thinking off, and a reasoning the prompt
opens may have a budget (``thinking.budget_tokens``, `ChatPrompt.reasoning_budget`:
the engine forces its end marker there); a budget with thinking off is refused.

``tool_choice`` ``required`` or a named function becomes a grammar (the call syntax
of the format, the arguments' schema: `call_grammar`) for the syntaxes mlxserve can
write one for: DSML (V4's and V4.1's) and mlx-lm's ``json_tools``; another format
refuses those two choices by name.
"""

from __future__ import annotations

from dataclasses import replace

from mlxserve.chat.call_grammar import ToolStyle
from mlxserve.chat.deepseek_v4.encoding import dialect_of
from mlxserve.chat.deepseek_v4.format import deepseek_v4_prompt
from mlxserve.chat.prompt import ChatPrompt, ChatTokenizer, Encode, ForcedCalls
from mlxserve.chat.request import ChatRequest, Function, NamedTool, Refused
from mlxserve.chat.template import template_prompt


def requested_thinking(body: ChatRequest) -> tuple[bool | None, str]:
    """The request's thinking switch (None: not asked) and the field that set it.

    ``thinking.type``, ``chat_template_kwargs.thinking`` / ``enable_thinking`` and
    ``reasoning_effort`` "none" (off) mean the same; when they disagree the request is
    refused rather than one picked.
    """
    asked: list[tuple[bool, str]] = []
    if body.thinking is not None:
        asked.append((body.thinking, "thinking"))
    if body.reasoning_effort == "none":
        asked.append((False, "reasoning_effort"))
    kwargs = body.chat_template_kwargs
    if kwargs is not None:
        for key in ("thinking", "enable_thinking"):
            value = getattr(kwargs, key)
            if value is not None:
                asked.append((value, f"chat_template_kwargs.{key}"))
    if len({value for value, _ in asked}) > 1:
        names = " and ".join(name for _, name in asked)
        raise Refused(f"{names} disagree", param=asked[-1][1])
    return (asked[0][0], asked[0][1]) if asked else (None, "thinking")


def build_prompt(
    body: ChatRequest,
    tokenizer: ChatTokenizer,
    default_thinking: bool | None,
    encode: Encode | None = None,
) -> ChatPrompt:
    """The prompt of ``body`` in the model's format; `Refused` names what it cannot honour."""
    encode = tokenizer.text_ids if encode is None else encode
    thinking, thinking_field = requested_thinking(body)
    if body.thinking_budget is not None and thinking is False:
        raise Refused(
            f"thinking.budget_tokens bounds the reasoning, and thinking is off ({thinking_field})",
            param="thinking.budget_tokens",
        )
    if body.reasoning_effort == "none":  # thinking off, said by requested_thinking
        body = replace(body, reasoning_effort=None)
    seen: set[str] = set()
    for i, tool in enumerate(body.tools):
        if tool.name in seen:  # a call could not say which one it meant
            raise Refused(f"two tools are named {tool.name!r}", param=f"tools.{i}.function.name")
        seen.add(tool.name)
    forced = forced_tools(body)
    _refuse_unkept_strict(body, forced)
    tools = [tool.declared() for tool in body.tools]
    if body.tool_choice == "none":
        tools = []
    style: ToolStyle | None
    if tokenizer.prompt_format == "deepseek_v4":
        on = thinking if thinking is not None else default_thinking is not False
        release = tokenizer.deepseek_release
        prompt = deepseek_v4_prompt(body, encode, on, tools, release)
        style = dialect_of(release).style
    else:
        prompt = template_prompt(
            body, tokenizer, encode, thinking, thinking_field, default_thinking
        )
        style = "json_tools" if tokenizer.tool_parser_name == "json_tools" else None
    if body.thinking_budget is not None:
        if prompt.reasoning_end is None:
            raise Refused(
                "thinking.budget_tokens: this prompt opens no reasoning to bound (thinking is off)",
                param="thinking.budget_tokens",
            )
        prompt = replace(prompt, reasoning_budget=body.thinking_budget)
    if forced is None:
        return prompt
    if style is None:
        raise Refused(
            f"tool_choice: mlxserve cannot force a call in this model's tool-call format "
            f"({tokenizer.tool_parser_name}); use 'auto'",
            param="tool_choice",
        )
    where = {tool.name: i for i, tool in enumerate(body.tools)}  # unique names
    calls = tuple((f"tools.{where[tool.name]}.function.parameters", tool) for tool in forced)
    return replace(prompt, forced=ForcedCalls(style, calls, body.parallel_tool_calls))


def forced_tools(body: ChatRequest) -> list[Function] | None:
    """The functions one of which the answer must call (None: the model chooses)."""
    choice = body.tool_choice
    if choice in ("auto", "none"):
        return None
    tools = list(body.tools)
    if not tools:
        raise Refused("tool_choice: there are no tools to call", param="tool_choice")
    if body.response_format is not None and body.response_format != "text":
        raise Refused(
            "response_format and a forced tool call cannot both shape the answer",
            param="response_format",
        )
    if isinstance(choice, NamedTool):
        named = [tool for tool in tools if tool.name == choice.name]
        if not named:
            raise Refused(
                f"tool_choice: no tool is named {choice.name!r}",
                param="tool_choice.function.name",
            )
        return named
    return tools


def _refuse_unkept_strict(body: ChatRequest, forced: list[Function] | None) -> None:
    """``strict: true`` promises arguments that follow the schema. A grammar keeps that
    promise where the answer must call the function; with ``auto`` nothing does, so
    there it is refused rather than accepted and broken."""
    for i, tool in enumerate(body.tools):
        if tool.strict and (forced is None or tool not in forced):
            raise Refused(
                "strict arguments are kept only where tool_choice forces a call of this "
                "function ('required' or its name); with 'auto' send strict: false",
                param=f"tools.{i}.function.strict",
            )
