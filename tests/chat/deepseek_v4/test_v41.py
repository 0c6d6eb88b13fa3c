# ruff: noqa: RUF001
"""DeepSeek-V4.1's dialect of the format, against strings its reference encoder wrote.

Every expected string is spelled out literally. Their sources are public (listed in
``docs/deepseek-v4-flash.md``): the model's own ``encoding/encoding.py`` (as vendored
unmodified by fastllm), SGLang's unit test of its V4.1 encoder (the multi-turn tool
case, from the first user turn on), ms-swift's V4.1 tools template, and the official
encoder's outputs as quoted in a deployment write-up (system token and effort line,
with and without a system message; a mid-conversation system message).
"""

import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from mlxserve.chat.call_grammar import ToolStyle, tool_grammar
from mlxserve.chat.deepseek_v4.dialect import V4, V4_1
from mlxserve.chat.deepseek_v4.dsml import DsmlParser
from mlxserve.chat.deepseek_v4.encoding import Message, PromptError, ToolCall, encode
from mlxserve.chat.request import Function
from mlxserve.chat.tool_calls import ParsedToolCall, Text, ToolOutput
from mlxserve.models.demo.build import WEIGHTS_DIR

B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
S = "<｜System｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"
EFFORT_75 = (
    "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
LOOKUP = {
    "name": "lookup",
    "description": "Look up a value",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
    },
}
V41_TOOLS = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke "
    'tools by writing a "<｜DSML｜ calls>" block like the following:\n\n'
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME">\n'
    '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    "</｜DSML｜ parameter>\n"
    "...\n"
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other '
    "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "lookup", "description": "Look up a value", "parameters": {"type": "object", '
    '"properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)


def v41(messages: list[Message], **kwargs: object) -> str:
    return encode(messages, release="v4.1", **kwargs)  # type: ignore[arg-type]


def test_system_message_tools_tool_results_and_thinking_render_as_the_reference() -> None:
    """SGLang's V4.1 encoder test case: reasoning kept (tools are given), both calls in
    one spaced block, the results reordered to the calls' order."""
    messages = [
        Message("system", "system"),
        Message("user", "question"),
        Message(
            "assistant",
            "summary",
            reasoning_content="reason",
            tool_calls=(
                ToolCall("lookup", '{"query": "first"}', "a"),
                ToolCall("lookup", '{"query": "second"}', "b"),
            ),
        ),
        Message("tool", "second result", tool_call_id="b"),
        Message("tool", "first result", tool_call_id="a"),
    ]
    expected = (
        f"{B}{S}{EFFORT_75}system\n\n{V41_TOOLS}"
        f"{U}question{A}<think>reason</think>summary\n\n"
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">first</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">second</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        f"</｜DSML｜ calls>{E}"
        f"{U}<tool_result>first result</tool_result>\n\n"
        f"<tool_result>second result</tool_result>{A}<think>"
    )
    assert v41(messages, thinking=True, tools=[LOOKUP]) == expected


def test_the_system_token_and_the_effort_line_as_the_official_encoder_writes_them() -> None:
    system, user = Message("system", "S"), Message("user", "U")
    assert v41([system, user], thinking=False) == f"{B}{S}S{U}U{A}</think>"
    assert v41([user], thinking=False) == f"{B}{U}U{A}</think>"
    assert v41([system, user], thinking=True) == f"{B}{S}{EFFORT_75}S{U}U{A}<think>"
    assert v41([user], thinking=True) == f"{B}{S}{EFFORT_75}{U}U{A}<think>"
    turns = [
        system,
        Message("user", "q1"),
        Message("assistant", "a1"),
        Message("system", "mid"),
        Message("user", "q2"),
    ]
    assert v41(turns, thinking=False) == (f"{B}{S}S{U}q1{A}</think>a1{E}{S}mid{U}q2{A}</think>")
    tools = v41([system, user], thinking=False, tools=[LOOKUP])
    assert tools == f"{B}{S}S\n\n{V41_TOOLS}{U}U{A}</think>"


def test_effort_is_a_number_from_1_to_100() -> None:
    user = [Message("user", "U")]
    for effort, budget in [("low", 50), ("high", 75), (None, 75), ("max", 100), (33, 33)]:
        prompt = v41(user, thinking=True, reasoning_effort=effort)
        assert prompt.startswith(f"{B}{S}Reasoning Effort: {budget} (range 1-100, "), effort
    for wrong in (0, 101, True):
        with pytest.raises(PromptError, match="1 to 100"):
            v41(user, thinking=True, reasoning_effort=wrong)
    with pytest.raises(PromptError, match=r"only V4\.1"):
        encode(user, thinking=True, reasoning_effort=50)


def test_a_mid_conversation_system_message_is_answered_and_ends_the_old_reasoning() -> None:
    """V4.1 counts a system message after the first as a user turn: the assistant
    answers one that ends the conversation, and reasoning before it is dropped."""
    turns = [
        Message("user", "q1"),
        Message("assistant", "a1", reasoning_content="r1"),
        Message("system", "new rule"),
    ]
    assert v41(turns, thinking=False) == f"{B}{U}q1{A}</think>a1{E}{S}new rule{A}</think>"
    assert v41(turns, thinking=True) == (
        f"{B}{S}{EFFORT_75}{U}q1{A}</think>a1{E}{S}new rule{A}<think>"
    )
    with pytest.raises(PromptError, match="system message after the first"):
        v41([Message("system", "alone")], thinking=False)
    with pytest.raises(PromptError, match="no developer role"):
        v41([Message("developer", "be brief"), Message("user", "U")], thinking=False)


def run(parser: DsmlParser, text: str, step: int) -> list[ToolOutput]:
    out: list[ToolOutput] = []
    for i in range(0, len(text), step):
        out += parser.push(text[i : i + step])
    return out + parser.finish()


def test_the_parser_reads_the_spaced_tags_and_leaves_the_other_dialect_as_text() -> None:
    block = (
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="limit" string="false">3</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>"
    )
    for step in (1, 3, 7, len(block)):
        out = run(DsmlParser(V4_1), "Let me look.\n\n" + block, step)
        calls = [piece for piece in out if isinstance(piece, ParsedToolCall)]
        text = "".join(piece.text for piece in out if isinstance(piece, Text))
        assert text == "Let me look."
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("lookup", {"query": "Paris", "limit": 3})
        ]
        v4_reads = run(DsmlParser(V4), block, step)  # V4's parser: no call, all text
        assert not any(isinstance(piece, ParsedToolCall) for piece in v4_reads)


def test_a_forced_call_grammar_writes_the_dialect_s_markup() -> None:
    """The grammar of a forced call accepts V4.1's block and not V4's, and the other
    way round, on the demo's tokenizer (byte-level: any text spells)."""
    ll = LLTokenizer(str(WEIGHTS_DIR / "tokenizer.json"))
    query: dict[str, object] = {"type": "string"}
    schema = {"type": "object", "properties": {"query": query}, "required": ["query"]}
    tool = Function("lookup", parameters=schema)
    v41_block = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="lookup">\n'
        '<｜DSML｜ parameter name="query" string="true">Paris</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    v4_block = (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="lookup">\n'
        '<｜DSML｜parameter name="query" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    styles: list[tuple[ToolStyle, str, str]] = [
        ("dsml_v41", v41_block, v4_block),
        ("dsml", v4_block, v41_block),
    ]
    for style, own, other in styles:
        grammar = tool_grammar(style, [tool], parallel=False)
        for text, accepted in [(own, True), (other, False)]:
            matcher = LLMatcher(ll, grammar, log_level=0)
            ok = matcher.consume_tokens(ll.tokenize_str(text)) and matcher.is_accepting()
            assert ok == accepted, (style, text)
