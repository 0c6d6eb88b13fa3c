# ruff: noqa: RUF001, RUF002
"""DeepSeek-V4's prompt format: a conversation to the exact text the model was trained on.

DeepSeek-V4 ships no chat template. Its prompt format is defined by the Python
reference encoder in the model repository (``encoding/encoding_dsv4.py``); this module
is our own implementation of that format, as pure functions, so the server can build
prompts the model has seen rather than a generic transcript.

The format, in short (the rules below follow the reference encoder):

- ``<｜begin▁of▁sentence｜>``, then (thinking mode with reasoning effort "max" only)
  a fixed directive, then the system text; consecutive system messages are joined
  with a blank line, and the tool schemas (if any) follow as a "## Tools" section.
- A user turn is ``<｜User｜>`` and its parts joined by a blank line; consecutive user
  and tool messages fold into one turn, a tool result as ``<tool_result>…</tool_result>``
  (V4 has no tool role). A developer message is a turn of its own, also after
  ``<｜User｜>``.
- After the last part of a user turn that an assistant turn follows (or that ends
  the conversation): ``<｜Assistant｜>`` and ``<think>`` (thinking mode, where the
  reasoning is kept) or ``</think>``.
- An assistant turn: its reasoning and ``</think>`` (when kept), its content, its
  tool calls in DSML after a blank line, then ``<｜end▁of▁sentence｜>``.
- The reasoning of turns before the last user message is dropped (``drop_thinking``),
  unless tools are given: the model must see why it made its earlier calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

DSML = "｜DSML｜"
TOOL_CALLS_START = f"<{DSML}tool_calls>"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_START = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_START = f"<{DSML}parameter"
PARAMETER_END = f"</{DSML}parameter>"

#: The directive that reasoning effort "max" puts before everything else.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem "
    "to resolve the root cause, rigorously stress-testing your logic against all potential "
    "paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no "
    "assumption is left unchecked.\n\n"
)

_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "{calls}" block like the following:

{calls}
{invoke} name="$TOOL_NAME">
{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{parameter_end}
...
{invoke_end}
{invoke} name="$TOOL_NAME2">
...
{invoke_end}
{calls_end}

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), \
pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete \
reasoning inside {think}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke \
tool calls.
"""

Role = Literal["system", "developer", "user", "assistant", "tool"]
ReasoningEffort = Literal["high", "max"]
REASONING_EFFORTS: tuple[ReasoningEffort, ...] = ("high", "max")


class PromptError(ValueError):
    """A conversation this format cannot express (the server answers 400)."""


@dataclass(frozen=True)
class ToolCall:
    """One call in an assistant message: the function's name and its JSON arguments."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


@dataclass
class _Turn:
    """A message after folding: user turns hold their parts, system turns the tools."""

    role: Literal["system", "developer", "user", "assistant"]
    text: str = ""
    parts: list[tuple[str, str]] = field(default_factory=list)  # (tool_call_id or "", text)
    is_result: list[bool] = field(default_factory=list)
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tools: Sequence[Mapping[str, Any]] = ()


def to_json(value: Any) -> str:
    """JSON as the reference writes it (``json.dumps`` defaults, non-ASCII kept)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def render_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The "## Tools" section: the call syntax and each function object on one line."""
    return _TOOLS_SECTION.format(
        calls=TOOL_CALLS_START,
        calls_end=TOOL_CALLS_END,
        invoke=INVOKE_START,
        invoke_end=INVOKE_END,
        parameter=PARAMETER_START,
        parameter_end=PARAMETER_END,
        think=THINK_START,
        think_end=THINK_END,
        schemas="\n".join(to_json(dict(tool)) for tool in tools),
    )


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    """Calls as the model writes them: one ``tool_calls`` block, one ``invoke`` per call.

    Arguments that are not a JSON object are kept whole under the key ``arguments``,
    as the reference does, rather than lost.
    """
    invokes = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = {"arguments": call.arguments}
        if not isinstance(arguments, dict):
            arguments = {"arguments": arguments}
        parameters = "\n".join(
            f'{PARAMETER_START} name="{key}" string="{str(isinstance(value, str)).lower()}">'
            f"{value if isinstance(value, str) else to_json(value)}{PARAMETER_END}"
            for key, value in arguments.items()
        )
        invokes.append(f'{INVOKE_START} name="{call.name}">\n{parameters}\n{INVOKE_END}')
    return f"{TOOL_CALLS_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _fold(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> list[_Turn]:
    """Join system messages, fold user and tool messages into user turns, attach tools."""
    turns: list[_Turn] = []
    for message in messages:
        last = turns[-1] if turns else None
        if message.role == "system":
            if last is not None and last.role == "system":
                last.text += "\n\n" + message.content
            else:
                turns.append(_Turn("system", text=message.content))
        elif message.role in ("user", "tool"):
            part = (message.tool_call_id, message.content)
            if last is None or last.role != "user":
                last = _Turn("user")
                turns.append(last)
            last.parts.append(part)
            last.is_result.append(message.role == "tool")
        elif message.role == "developer":
            if not message.content:
                raise PromptError("a developer message needs content")
            turns.append(_Turn("developer", text=message.content))
        else:
            turns.append(
                _Turn(
                    "assistant",
                    text=message.content,
                    reasoning=message.reasoning_content,
                    tool_calls=message.tool_calls,
                )
            )
    if tools:
        if turns and turns[0].role == "system":
            turns[0].tools = tools
        else:
            turns.insert(0, _Turn("system", tools=tools))
    _order_results(turns)
    return turns


def _order_results(turns: list[_Turn]) -> None:
    """Tool results in the order of the calls that asked for them (clients may reorder)."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {call.id: i for i, call in enumerate(turn.tool_calls) if call.id}
        elif turn.role == "user" and order and sum(turn.is_result) > 1:
            results = [p for p, r in zip(turn.parts, turn.is_result, strict=True) if r]
            ordered = iter(sorted(results, key=lambda part: order.get(part[0], 0)))
            turn.parts = [
                next(ordered) if r else p for p, r in zip(turn.parts, turn.is_result, strict=True)
            ]


def _last_user(turns: Sequence[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _drop_old_reasoning(turns: list[_Turn]) -> list[_Turn]:
    """Before the last user turn: assistant reasoning goes, developer turns go."""
    last = _last_user(turns)
    kept: list[_Turn] = []
    for i, turn in enumerate(turns):
        if i >= last or turn.role in ("user", "system"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, reasoning=None))
    return kept


def _render(turn: _Turn, thinking: bool, keep_reasoning: bool) -> str:
    if turn.role == "system":
        text = turn.text
        return text + ("\n\n" + render_tools(turn.tools) if turn.tools else "")
    if turn.role == "developer":
        return USER + turn.text
    if turn.role == "user":
        parts = [
            f"<tool_result>{text}</tool_result>" if result else text
            for (_, text), result in zip(turn.parts, turn.is_result, strict=True)
        ]
        return USER + "\n\n".join(parts)
    reasoning = (turn.reasoning or "") + THINK_END if thinking and keep_reasoning else ""
    calls = "\n\n" + render_tool_calls(turn.tool_calls) if turn.tool_calls else ""
    return reasoning + turn.text + calls + EOS


def encode(
    messages: Sequence[Message],
    *,
    thinking: bool,
    tools: Sequence[Mapping[str, Any]] = (),
    reasoning_effort: ReasoningEffort | None = None,
    drop_thinking: bool = True,
) -> str:
    """The prompt text for the assistant's next turn (``BOS`` included).

    ``tools`` are OpenAI function objects (``name``, ``description``, ``parameters``).
    ``reasoning_effort`` matters in thinking mode only; "high" renders like unset.
    """
    if not messages or messages[-1].role not in ("user", "developer", "tool"):
        raise PromptError("the conversation must end with a user, developer or tool message")
    turns = _fold(messages, tools)
    drop = drop_thinking and not tools
    if thinking and drop:
        turns = _drop_old_reasoning(turns)
    last_user = _last_user(turns)
    prompt = BOS
    if thinking and reasoning_effort == "max":
        prompt += REASONING_EFFORT_MAX
    for i, turn in enumerate(turns):
        prompt += _render(turn, thinking, keep_reasoning=not drop or i > last_user)
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if turn.role in ("user", "developer") and following in (None, "assistant"):
            opens = thinking and (not drop or i >= last_user)
            prompt += ASSISTANT + (THINK_START if opens else THINK_END)
    return prompt
