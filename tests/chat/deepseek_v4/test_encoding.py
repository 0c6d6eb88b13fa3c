# ruff: noqa: RUF001
"""DeepSeek-V4's prompt encoder against prompts written out by hand from the published format.

Every expected string below is spelled out literally (tokens, newlines, the tools
section), not built with the encoder's own helpers, so a drift in either shows.
"""

import pytest

from mlxserve.chat.deepseek_v4.encoding import Message, PromptError, ToolCall, encode

B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
WEATHER_JSON = (
    '{"name": "get_weather", "description": "Weather of a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}}}'
)
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke "
    'tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    "</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other '
    "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    f"{WEATHER_JSON}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
CALL = ToolCall("get_weather", '{"city": "Paris", "days": 3}', id="c1")
CALL_DSML = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def user(text: str) -> Message:
    return Message("user", text)


def test_single_user_chat_mode() -> None:
    assert encode([user("Hi")], thinking=False) == f"{B}{U}Hi{A}</think>"


def test_single_user_thinking_mode() -> None:
    assert encode([user("Hi")], thinking=True) == f"{B}{U}Hi{A}<think>"


def test_system_messages_run_together() -> None:
    """Nothing between consecutive system messages, as DeepSeek's reference writes them."""
    messages = [Message("system", "Be brief."), Message("system", "Be kind."), user("Hi")]
    assert encode(messages, thinking=False) == f"{B}Be brief.Be kind.{U}Hi{A}</think>"


def test_reasoning_effort_max_prefix_in_thinking_mode_only() -> None:
    messages = [Message("system", "S"), user("Hi")]
    assert (
        encode(messages, thinking=True, reasoning_effort="max")
        == f"{B}{MAX_PREFIX}S{U}Hi{A}<think>"
    )
    assert encode(messages, thinking=False, reasoning_effort="max") == f"{B}S{U}Hi{A}</think>"


def test_reasoning_effort_high_renders_like_unset() -> None:
    messages = [user("Hi")]
    assert encode(messages, thinking=True, reasoning_effort="high") == encode(
        messages, thinking=True
    )


def test_history_chat_mode_has_no_reasoning() -> None:
    messages = [
        user("Q1"),
        Message("assistant", "A1", reasoning_content="R1"),
        user("Q2"),
    ]
    expected = f"{B}{U}Q1{A}</think>A1{E}{U}Q2{A}</think>"
    assert encode(messages, thinking=False) == expected


def test_history_thinking_mode_drops_earlier_reasoning() -> None:
    messages = [
        user("Q1"),
        Message("assistant", "A1", reasoning_content="R1"),
        user("Q2"),
    ]
    expected = f"{B}{U}Q1{A}</think>A1{E}{U}Q2{A}<think>"
    assert encode(messages, thinking=True) == expected


def test_history_thinking_mode_keeps_reasoning_without_drop() -> None:
    messages = [
        user("Q1"),
        Message("assistant", "A1", reasoning_content="R1"),
        user("Q2"),
    ]
    expected = f"{B}{U}Q1{A}<think>R1</think>A1{E}{U}Q2{A}<think>"
    assert encode(messages, thinking=True, drop_thinking=False) == expected


def test_tools_section_in_a_new_system_text() -> None:
    expected = f"{B}\n\n{TOOLS_SECTION}{U}Weather?{A}</think>"
    assert encode([user("Weather?")], thinking=False, tools=[WEATHER]) == expected


def test_tools_section_after_the_system_text() -> None:
    messages = [Message("system", "S"), user("Weather?")]
    expected = f"{B}S\n\n{TOOLS_SECTION}{U}Weather?{A}<think>"
    assert encode(messages, thinking=True, tools=[WEATHER]) == expected


def test_tool_call_round_trip_chat_mode() -> None:
    messages = [
        user("Weather in Paris?"),
        Message("assistant", "", tool_calls=(CALL,)),
        Message("tool", '{"temp": 20}', tool_call_id="c1"),
    ]
    expected = (
        f"{B}\n\n{TOOLS_SECTION}{U}Weather in Paris?{A}</think>\n\n{CALL_DSML}{E}"
        f'{U}<tool_result>{{"temp": 20}}</tool_result>{A}</think>'
    )
    assert encode(messages, thinking=False, tools=[WEATHER]) == expected


def test_tools_keep_all_reasoning_in_thinking_mode() -> None:
    """With tools, drop_thinking is off: earlier turns keep their reasoning too."""
    messages = [
        user("Q0"),
        Message("assistant", "A0", reasoning_content="R0"),
        user("Weather in Paris?"),
        Message("assistant", "Let me look.", reasoning_content="R1", tool_calls=(CALL,)),
        Message("tool", "sunny", tool_call_id="c1"),
    ]
    expected = (
        f"{B}\n\n{TOOLS_SECTION}{U}Q0{A}<think>R0</think>A0{E}"
        f"{U}Weather in Paris?{A}<think>R1</think>Let me look.\n\n{CALL_DSML}{E}"
        f"{U}<tool_result>sunny</tool_result>{A}<think>"
    )
    assert encode(messages, thinking=True, tools=[WEATHER]) == expected


def test_tool_loop_without_tools_drops_reasoning_before_the_results() -> None:
    """No tools given: the results are the last user turn, so the call's reasoning goes."""
    messages = [
        user("Weather?"),
        Message("assistant", "", reasoning_content="R1", tool_calls=(CALL,)),
        Message("tool", "sunny", tool_call_id="c1"),
    ]
    expected = (
        f"{B}{U}Weather?{A}</think>\n\n{CALL_DSML}{E}{U}<tool_result>sunny</tool_result>{A}<think>"
    )
    assert encode(messages, thinking=True) == expected


def test_user_and_tool_messages_fold_into_one_turn_in_call_order() -> None:
    calls = (
        ToolCall("a", '{"x": "1"}', id="first"),
        ToolCall("b", '{"ok": true, "n": [1, 2]}', id="second"),
    )
    messages = [
        user("Go"),
        Message("assistant", "", tool_calls=calls),
        Message("tool", "B", tool_call_id="second"),
        Message("tool", "A", tool_call_id="first"),
        user("and?"),
    ]
    expected = (
        f"{B}{U}Go{A}</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="a">\n'
        '<｜DSML｜parameter name="x" string="true">1</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="b">\n'
        '<｜DSML｜parameter name="ok" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">[1, 2]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
        f"{U}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand?{A}</think>"
    )
    assert encode(messages, thinking=False) == expected


def test_consecutive_user_messages_fold() -> None:
    messages = [user("one"), user("two")]
    assert encode(messages, thinking=False) == f"{B}{U}one\n\ntwo{A}</think>"


def test_developer_message_is_its_own_user_marked_turn() -> None:
    messages = [Message("system", "S"), user("Q"), Message("developer", "D")]
    assert encode(messages, thinking=False) == f"{B}S{U}Q{U}D{A}</think>"


def test_developer_before_the_last_user_is_dropped_in_thinking_mode() -> None:
    messages = [
        Message("developer", "D"),
        Message("assistant", "A1", reasoning_content="R1"),
        user("Q2"),
    ]
    assert encode(messages, thinking=True) == f"{B}A1{E}{U}Q2{A}<think>"
    assert encode(messages, thinking=False) == f"{B}{U}D{A}</think>A1{E}{U}Q2{A}</think>"


def test_everything_together_max_effort_tools_history() -> None:
    messages = [
        Message("system", "S1"),
        Message("system", "S2"),
        user("Q1"),
        Message("assistant", "", reasoning_content="think", tool_calls=(CALL,)),
        Message("tool", "rain", tool_call_id="c1"),
        Message("assistant", "It rains.", reasoning_content="easy"),
        user("Thanks"),
    ]
    expected = (
        f"{B}{MAX_PREFIX}S1\n\n{TOOLS_SECTION}S2"
        f"{U}Q1{A}<think>think</think>\n\n{CALL_DSML}{E}"
        f"{U}<tool_result>rain</tool_result>{A}<think>easy</think>It rains.{E}"
        f"{U}Thanks{A}<think>"
    )
    assert encode(messages, thinking=True, tools=[WEATHER], reasoning_effort="max") == expected


def test_a_finished_transcript_ends_with_the_answer() -> None:
    messages = [user("Q"), Message("assistant", "A", reasoning_content="R")]
    assert encode(messages, thinking=True) == f"{B}{U}Q{A}<think>R</think>A{E}"


SCHEMA_SECTION = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
    '{"type": "object"}'
)


def test_request_tools_and_schema_go_on_a_leading_developer_message() -> None:
    """As vLLM attaches them; with tools nothing is dropped, so neither is lost."""
    messages = [Message("developer", "D"), Message("assistant", "A1"), user("Q")]
    expected = (
        f"{B}{U}D\n\n{TOOLS_SECTION}\n\n{SCHEMA_SECTION}{A}<think></think>A1{E}{U}Q{A}<think>"
    )
    schema = {"type": "object"}
    assert encode(messages, thinking=True, tools=[WEATHER], response_format=schema) == expected


def test_a_schema_alone_goes_before_a_developer_message_thinking_drops() -> None:
    messages = [Message("developer", "D"), Message("assistant", "A1"), user("Q")]
    expected = f"{B}\n\n{SCHEMA_SECTION}A1{E}{U}Q{A}<think>"
    assert encode(messages, thinking=True, response_format={"type": "object"}) == expected


def test_non_object_arguments_are_kept_whole() -> None:
    messages = [
        user("Q"),
        Message("assistant", "ok", tool_calls=(ToolCall("f", "not json", id="x"),)),
        Message("tool", "r", tool_call_id="x"),
    ]
    expected = (
        f"{B}{U}Q{A}</think>ok\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}{U}<tool_result>r</tool_result>{A}</think>"
    )
    assert encode(messages, thinking=False) == expected


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [Message("system", "S")],
        [user("Q"), Message("developer", "")],
    ],
)
def test_conversations_the_format_cannot_end_with(messages: list[Message]) -> None:
    with pytest.raises(PromptError):
        encode(messages, thinking=True)
