# ruff: noqa: RUF001, RUF002
"""DeepSeek-V4's prompt format: a conversation to the exact text the model was trained on.

DeepSeek-V4 ships no chat template. Its prompt format is defined by the Python
reference encoder in the model repository (``encoding/encoding_dsv4.py``); this module
is our own implementation of that format, as pure functions, so the server can build
prompts the model has seen rather than a generic transcript. The reference's own test
cases, and more whose expected text the reference wrote, are held byte for byte in
``tests/chat/deepseek_v4/test_reference.py``.

The format, in short:

- ``<｜begin▁of▁sentence｜>``, then (thinking mode, reasoning effort "max"; on -0731
  "high" or "max") a fixed directive (`effort_prompt`), then the messages in order.
- A system message is its text as it is: consecutive ones run together with nothing
  between. The tool schemas (a "## Tools" section) and the answer's schema (a
  "## Response Format" section) follow the text of the message that carries them,
  each after a blank line.
- A user turn is ``<｜User｜>`` and its parts joined by a blank line: consecutive user
  and tool messages fold into one turn, a tool result as ``<tool_result>…</tool_result>``
  (V4 has no tool role; a result given as a list of parts has them joined by a blank
  line). A developer message is a turn of its own, also after ``<｜User｜>``, and
  carries tools and a schema as a system message does.
- After a user or developer turn that an assistant turn follows (or that ends the
  conversation): ``<｜Assistant｜>`` and ``<think>`` (thinking mode, where the
  reasoning is kept) or ``</think>``.
- An assistant turn: its reasoning and ``</think>`` (when kept), its content, its
  tool calls in DSML after a blank line, then ``<｜end▁of▁sentence｜>``. A conversation
  may end with one (a finished transcript, as ``/tokenize`` shows it).
- The reasoning of turns before the last user message is dropped, and developer
  messages before it with it (``drop_thinking``), unless tools are given: the model
  must see why it made its earlier calls.
- Two pieces of DeepSeek's own pipelines, kept so that the reference's cases all
  encode: the ``latest_reminder`` role (``<｜latest_reminder｜>`` and its text: a date,
  a place) and a user message's quick-instruction ``task``, whose marker ends the turn
  in place of the assistant's opening (``action``: after it).

DeepSeek-V4.1 (``release="v4.1"``) is the same format in its own dialect
(`dialect.V4_1`, from its reference ``encoding/encoding.py``): spaced DSML tag
names, ``<｜System｜>`` before the leading system text (and before the effort line,
``Reasoning Effort: N (range 1-100, ...)``, which thinking mode always writes), and
system messages mid-conversation, each after ``<｜System｜>`` and answered as a user
turn is. It has no developer role.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from mlxserve.chat.deepseek_v4.dialect import V4, V4_1, Dialect

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"

#: V4's DSML markers (V4.1 spells them its own way: `dialect`).
TOOL_CALLS_START = V4.calls_start
TOOL_CALLS_END = V4.calls_end
INVOKE_START = V4.invoke_start
INVOKE_END = V4.invoke_end
PARAMETER_START = V4.parameter_start
PARAMETER_END = V4.parameter_end

#: The directive that reasoning effort "max" puts before everything else (-0731: "high").
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem "
    "to resolve the root cause, rigorously stress-testing your logic against all potential "
    "paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no "
    "assumption is left unchecked.\n\n"
)
#: -0731's directive for reasoning effort "max".
REASONING_EFFORT_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every "
    "causal chain to its root, and resolve the underlying cause rather than any surface "
    "symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n"
)

#: V4.1's effort line: a number from 1 to 100 (`effort_prompt`).
REASONING_EFFORT_BUDGET = (
    "Reasoning Effort: {budget} "
    "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
#: V4.1's number for each named effort; unset is "high".
V41_EFFORT_BUDGETS: dict[str, int] = {"low": 50, "high": 75, "max": 100}

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

_RESPONSE_FORMAT_SECTION = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)

Role = Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
ReasoningEffort = Literal["low", "high", "max"]
REASONING_EFFORTS: tuple[ReasoningEffort, ...] = ("low", "high", "max")
#: The checkpoints whose prompts differ: V4 as first published, -0731 (its effort
#: prompts: `effort_prompt`), and V4.1 (its own dialect and numeric effort).
DeepSeekRelease = Literal["v4", "v4-0731", "v4.1"]
Task = Literal["action", "query", "authority", "domain", "title", "read_url"]
#: Each quick-instruction task's marker.
TASKS: dict[str, str] = {task: f"<｜{task}｜>" for task in get_args(Task)}


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
    #: The text; a tool result may come as parts (joined by a blank line).
    content: str | tuple[str, ...] = ""
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    #: System or developer message: the function objects its text lists.
    tools: tuple[Mapping[str, Any], ...] = ()
    #: System or developer message: the JSON schema the answer must follow.
    response_format: Mapping[str, Any] | None = None
    #: User message: a quick-instruction task (its marker ends the turn).
    task: Task | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n\n".join(self.content)


@dataclass
class _Turn:
    """A message after folding: user turns hold their parts (and results)."""

    role: Role  # never "tool": results fold into user turns
    text: str = ""
    parts: list[tuple[str, str]] = field(default_factory=list)  # (tool_call_id or "", text)
    is_result: list[bool] = field(default_factory=list)
    task: Task | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tools: Sequence[Mapping[str, Any]] = ()
    response_format: Mapping[str, Any] | None = None


def to_json(value: Any) -> str:
    """JSON as the reference writes it (``json.dumps`` defaults, non-ASCII kept)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return json.dumps(value, ensure_ascii=True)


def render_tools(tools: Sequence[Mapping[str, Any]], dialect: Dialect = V4) -> str:
    """The "## Tools" section: the call syntax and each function object on one line."""
    return _TOOLS_SECTION.format(
        calls=dialect.calls_start,
        calls_end=dialect.calls_end,
        invoke=dialect.invoke_start,
        invoke_end=dialect.invoke_end,
        parameter=dialect.parameter_start,
        parameter_end=dialect.parameter_end,
        think=THINK_START,
        think_end=THINK_END,
        schemas="\n".join(to_json(dict(tool)) for tool in tools),
    )


def render_tool_calls(calls: Sequence[ToolCall], dialect: Dialect = V4) -> str:
    """Calls as the model writes them: one calls block, one ``invoke`` per call.

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
            f'{dialect.parameter_start} name="{key}" string="{str(isinstance(value, str)).lower()}"'
            f">{value if isinstance(value, str) else to_json(value)}{dialect.parameter_end}"
            for key, value in arguments.items()
        )
        invokes.append(
            f'{dialect.invoke_start} name="{call.name}">\n{parameters}\n{dialect.invoke_end}'
        )
    return f"{dialect.calls_start}\n" + "\n".join(invokes) + f"\n{dialect.calls_end}"


def _attach(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]],
    response_format: Mapping[str, Any] | None,
) -> Sequence[Message]:
    """The request's tools and schema on the message whose text shows them: a leading
    system message, or a leading developer message when there are tools (as vLLM does,
    the shape of the reference's own search case; without tools a developer message
    before the last user turn is dropped in thinking mode, and the schema with it),
    else a new system message in front."""
    if not tools and not response_format:
        return messages
    first = messages[0]
    if first.role == "system" or (first.role == "developer" and tools):
        given = replace(
            first,
            tools=tuple(tools) or first.tools,
            response_format=response_format or first.response_format,
        )
        return [given, *messages[1:]]
    return [Message("system", tools=tuple(tools), response_format=response_format), *messages]


def _fold(messages: Sequence[Message]) -> list[_Turn]:
    """Fold user and tool messages into user turns; every other message is a turn."""
    turns: list[_Turn] = []
    for message in messages:
        last = turns[-1] if turns else None
        if message.role in ("user", "tool"):
            result = message.role == "tool"
            # A turn with a task ends with its marker: a user message after it starts anew.
            if last is None or last.role != "user" or (not result and last.task is not None):
                last = _Turn("user", task=None if result else message.task)
                turns.append(last)
            last.parts.append((message.tool_call_id, message.text))
            last.is_result.append(result)
        elif message.role == "assistant":
            turns.append(
                _Turn(
                    "assistant",
                    text=message.text,
                    reasoning=message.reasoning_content,
                    tool_calls=message.tool_calls,
                )
            )
        else:
            if message.role == "developer" and not message.text:
                raise PromptError("a developer message needs content")
            turns.append(
                _Turn(
                    message.role,
                    text=message.text,
                    tools=message.tools,
                    response_format=message.response_format,
                )
            )
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


def dialect_of(release: DeepSeekRelease) -> Dialect:
    """The strings a checkpoint spells its way: V4.1's, or V4's (-0731 included)."""
    return V4_1 if release == "v4.1" else V4


def _answered(turns: Sequence[_Turn], i: int, dialect: Dialect) -> bool:
    """Whether the assistant answers turn ``i``: a user or developer turn, and in V4.1 a
    system message after the first (V4.1's mid-conversation system messages)."""
    role = turns[i].role
    return role in ("user", "developer") or (
        dialect.system_token is not None and role == "system" and i > 0
    )


def _last_user(turns: Sequence[_Turn], dialect: Dialect) -> int:
    return max((i for i in range(len(turns)) if _answered(turns, i, dialect)), default=-1)


def _drop_old_reasoning(turns: list[_Turn], dialect: Dialect) -> list[_Turn]:
    """Before the last user turn: assistant reasoning goes, developer turns go."""
    last = _last_user(turns, dialect)
    kept: list[_Turn] = []
    for i, turn in enumerate(turns):
        if i >= last or turn.role in ("user", "system", "latest_reminder"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, reasoning=None))
    return kept


def _render(
    turn: _Turn, thinking: bool, keep_reasoning: bool, dialect: Dialect, first: bool
) -> str:
    if turn.role in ("system", "developer"):
        text = turn.text
        if turn.tools:
            text += "\n\n" + render_tools(turn.tools, dialect)
        if turn.response_format:
            text += "\n\n" + _RESPONSE_FORMAT_SECTION + to_json(dict(turn.response_format))
        if turn.role == "developer":
            return USER + text
        # V4.1: the first system message's token leads the prompt (`encode`).
        return (dialect.system_token or "") + text if not first else text
    if turn.role == "latest_reminder":
        return LATEST_REMINDER + turn.text
    if turn.role == "user":
        parts = [
            f"<tool_result>{text}</tool_result>" if result else text
            for (_, text), result in zip(turn.parts, turn.is_result, strict=True)
        ]
        return USER + "\n\n".join(parts)
    reasoning = (turn.reasoning or "") + THINK_END if thinking and keep_reasoning else ""
    calls = "\n\n" + render_tool_calls(turn.tool_calls, dialect) if turn.tool_calls else ""
    return reasoning + turn.text + calls + EOS


def _opening(turn: _Turn, thinking: bool, opens: bool, answered: bool) -> str:
    """What ends a turn the assistant answers: its task's marker, or the assistant's
    opening (``<think>`` where ``opens``)."""
    if turn.task == "action":
        return ASSISTANT + (THINK_START if thinking else THINK_END) + TASKS[turn.task]
    if turn.task is not None:
        return TASKS[turn.task]
    if answered:
        return ASSISTANT + (THINK_START if opens else THINK_END)
    return ""


def effort_prompt(effort: ReasoningEffort | int | None, release: DeepSeekRelease = "v4") -> str:
    """The directive a reasoning effort puts before everything else (thinking mode).

    V4 has one: "max"'s ("Absolute maximum"); "low", "high" and unset have none.
    -0731 moved it down to "high", and "max" has a stronger one ("Beyond maximum");
    "low" and unset have none (as vLLM's -0731 encoding tests assert). V4.1 always
    has one, a number from 1 to 100: "low" 50, "high" (and unset) 75, "max" 100, or
    the number given.
    """
    if release == "v4.1":
        budget = effort if isinstance(effort, int) else V41_EFFORT_BUDGETS[effort or "high"]
        if isinstance(budget, bool) or not 1 <= budget <= 100:
            raise PromptError(f"reasoning effort {effort!r}: V4.1 takes 1 to 100")
        return REASONING_EFFORT_BUDGET.format(budget=budget)
    if isinstance(effort, int):
        raise PromptError(f"reasoning effort {effort}: only V4.1 takes a number")
    if release == "v4-0731":
        return {"high": REASONING_EFFORT_MAX, "max": REASONING_EFFORT_BEYOND_MAX}.get(
            effort or "", ""
        )
    return REASONING_EFFORT_MAX if effort == "max" else ""


def encode(
    messages: Sequence[Message],
    *,
    thinking: bool,
    tools: Sequence[Mapping[str, Any]] = (),
    response_format: Mapping[str, Any] | None = None,
    reasoning_effort: ReasoningEffort | int | None = None,
    drop_thinking: bool = True,
    release: DeepSeekRelease = "v4",
) -> str:
    """The prompt text for the assistant's next turn (``BOS`` included), or the whole
    transcript when the conversation ends with an assistant message.

    ``tools`` are OpenAI function objects (``name``, ``description``, ``parameters``)
    and ``response_format`` a JSON schema, the request's: they go on a leading system
    message (`_attach`). ``reasoning_effort`` matters in thinking mode only, its
    directive per checkpoint (``release``, `effort_prompt`). ``release`` also picks the
    dialect (`dialect_of`): V4.1's system token leads the prompt where there is an
    effort line or a leading system message, and comes before each later system
    message, which the assistant then answers.
    """
    dialect = dialect_of(release)
    if dialect.system_token is None:
        endings = "a user, developer, tool or assistant message"
        ends = bool(messages) and messages[-1].role in ("user", "developer", "tool", "assistant")
    else:  # V4.1: a system message after the first is answered too
        if any(m.role == "developer" for m in messages):
            raise PromptError(
                "DeepSeek-V4.1's format has no developer role; send it as a system message"
            )
        endings = "a user, tool or assistant message, or a system message after the first"
        ends = bool(messages) and (
            messages[-1].role in ("user", "tool", "assistant")
            or (messages[-1].role == "system" and len(messages) > 1)
        )
    if not ends:
        raise PromptError(f"the conversation must end with {endings}")
    messages = _attach(messages, tools, response_format)
    turns = _fold(messages)
    drop = drop_thinking and not any(message.tools for message in messages)
    if thinking and drop:
        turns = _drop_old_reasoning(turns, dialect)
    last_user = _last_user(turns, dialect)
    head = effort_prompt(reasoning_effort, release)
    prompt = BOS
    if dialect.system_token is not None and ((thinking and head) or turns[0].role == "system"):
        prompt += dialect.system_token
    if thinking:
        prompt += head
    for i, turn in enumerate(turns):
        after_task = i > 0 and turns[i - 1].task is not None  # a task's answer: no reasoning
        keep = (not drop or i > last_user) and not after_task
        prompt += _render(turn, thinking, keep_reasoning=keep, dialect=dialect, first=i == 0)
        following = turns[i + 1].role if i + 1 < len(turns) else None
        if following in (None, "assistant", "latest_reminder"):
            opens = thinking and (not drop or i >= last_user)
            prompt += _opening(turn, thinking, opens, _answered(turns, i, dialect))
    return prompt
