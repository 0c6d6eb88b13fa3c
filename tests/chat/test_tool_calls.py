"""mlx-lm's tool parsers behind `ToolCallParser`: text streams, a call is held until it ends."""

import json
from typing import Any

from mlxserve.chat.tool_calls import MarkedToolParser, ParsedToolCall, Text

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_the_parser_streams_text_and_holds_calls_until_they_end() -> None:
    parser = MarkedToolParser("<tool_call>", "</tool_call>", lambda t, _: json.loads(t), None)
    pieces: list[Any] = []
    for i in range(0, len("Sure. " + CALL + " done"), 3):
        pieces += parser.push(("Sure. " + CALL + " done")[i : i + 3])
    pieces += parser.finish()
    text = "".join(p.text for p in pieces if isinstance(p, Text))
    [call] = [p for p in pieces if isinstance(p, ParsedToolCall)]
    assert text == "Sure.  done"
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    broken = MarkedToolParser("<tool_call>", "</tool_call>", lambda t, _: json.loads(t), None)
    out = broken.push("<tool_call>{not json</tool_call>") + broken.finish()
    assert [(o.text, o.malformed) for o in out if isinstance(o, Text)] == [
        ("<tool_call>{not json</tool_call>", True)
    ]
    unclosed = MarkedToolParser("<tool_call>", "</tool_call>", lambda t, _: json.loads(t), None)
    assert unclosed.push("<tool_call>{") == []
    assert unclosed.finish() == [Text("<tool_call>{", malformed=True)]
