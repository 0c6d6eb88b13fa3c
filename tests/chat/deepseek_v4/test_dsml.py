# ruff: noqa: RUF001
"""The DSML tool-call parser: whole blocks become calls, anything broken comes back as text."""

import json
import random
import re

import pytest

from mlxserve.chat.deepseek_v4.dsml import DsmlParser, MalformedDsml, parse_block
from mlxserve.chat.deepseek_v4.encoding import ToolCall, render_tool_calls
from mlxserve.chat.tool_calls import ParsedToolCall, Text, ToolOutput

BLOCK = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris "centre"\n2e</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="opts" string="false">'
    '{"unit": "C", "hourly": [1, 2]}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n'
    "\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)

EMPTY_BLOCK = re.compile(r"<｜DSML｜tool_calls>\s*</｜DSML｜tool_calls>")


def run(text: str, step: int) -> list[ToolOutput]:
    """Feed ``text`` in pieces of ``step`` characters, as a stream would."""
    parser = DsmlParser()
    out: list[ToolOutput] = []
    for i in range(0, len(text), step):
        out += parser.push(text[i : i + step])
    return out + parser.finish()


def text_of(outputs: list[ToolOutput]) -> str:
    return "".join(o.text for o in outputs if isinstance(o, Text))


def calls_of(outputs: list[ToolOutput]) -> list[ParsedToolCall]:
    return [o for o in outputs if isinstance(o, ParsedToolCall)]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_calls_in_any_split_with_content_before(step: int) -> None:
    out = run("Let me check.\n\n" + BLOCK, step)
    assert text_of(out) == "Let me check."
    calls = calls_of(out)
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {
        "city": 'Paris "centre"\n2e',
        "days": 3,
        "opts": {"unit": "C", "hourly": [1, 2]},
    }
    assert calls[0].fragments[0].startswith('{"city": ')
    assert json.loads(calls[1].arguments) == {}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert not any(isinstance(o, Text) and "DSML" in o.text for o in out)


def test_round_trip_with_the_encoders_rendering() -> None:
    calls = [ToolCall("f", '{"a": "x", "b": [true, null], "c": 1.5}'), ToolCall("g", "{}")]
    parsed = parse_block(
        render_tool_calls(calls).removeprefix("<｜DSML｜tool_calls>")[
            : -len("</｜DSML｜tool_calls>")
        ]
    )
    assert [(p.name, json.loads(p.arguments)) for p in parsed] == [
        ("f", {"a": "x", "b": [True, None], "c": 1.5}),
        ("g", {}),
    ]


def test_plain_text_passes_through_whole() -> None:
    text = "No tools here: <｜DSML｜ is not a block, nor is <｜DSML｜tool_call.\n"
    for step in (1, 4, 100):
        assert text_of(run(text, step)) == text


@pytest.mark.parametrize(
    "broken",
    [
        BLOCK[: -len("</｜DSML｜tool_calls>")],  # never closed
        BLOCK.replace('string="false">3<', 'string="false">3x<'),  # bad JSON
        BLOCK.replace('name="get_weather"', ""),  # no name
        BLOCK.replace('string="true"', 'string="maybe"'),  # bad attribute
        BLOCK.replace('name="days"', 'name="city"'),  # a parameter twice
        BLOCK.replace("</｜DSML｜invoke>\n<", "<", 1),  # invoke not closed
    ],
)
def test_malformed_blocks_come_back_as_text(broken: str) -> None:
    for step in (1, 5, 10_000):
        parser = DsmlParser()
        out: list[ToolOutput] = []
        for i in range(0, len(broken), step):
            out += parser.push(broken[i : i + step])
        out += parser.finish()
        assert calls_of(out) == []
        assert text_of(out) == broken
        assert any(isinstance(o, Text) and o.malformed for o in out)


def test_parse_block_names_the_problem() -> None:
    with pytest.raises(MalformedDsml, match="not JSON"):
        parse_block(
            '\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="a" string="false">nope</｜DSML｜parameter>\n'
            "</｜DSML｜invoke>\n"
        )


def test_whitespace_after_a_block_is_dropped_text_after_it_kept() -> None:
    assert text_of(run(BLOCK + "\n\n", 3)) == ""
    assert text_of(run(BLOCK + "\nDone.", 3)) == "Done."


def test_a_split_anywhere_reads_as_the_whole() -> None:
    """Text around a block, cut in two at every place (at the block's last character
    too, where the whitespace after it arrives in the next piece)."""
    text = "Let me check.  \n\n" + BLOCK + "\n \nDone.\n\n"
    whole = run(text, len(text))
    assert text_of(whole) == "Let me check.  Done.\n\n" and len(calls_of(whole)) == 2
    for cut in range(1, len(text)):
        parser = DsmlParser()
        out = parser.push(text[:cut]) + parser.push(text[cut:]) + parser.finish()
        assert text_of(out) == text_of(whole), cut
        assert [c.arguments for c in calls_of(out)] == [c.arguments for c in calls_of(whole)]


PIECES = [
    "<｜DSML｜tool_calls>",
    "</｜DSML｜tool_calls>",
    '<｜DSML｜invoke name="f">',
    "</｜DSML｜invoke>",
    '<｜DSML｜parameter name="a" string="false">',
    '<｜DSML｜parameter name="b" string="true">',
    "</｜DSML｜parameter>",
    "1",
    "x",
    " ",
    "\n",
    "<",
    "｜",
    '"',
]


def test_random_mixtures_never_raise_and_lose_no_text() -> None:
    """Bounded fuzz: whatever the model writes, the parser answers; without a valid
    call or an empty block (which vanishes), the text comes back exactly as written."""
    rng = random.Random(14)
    for _ in range(400):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randrange(1, 30)))
        out = run(text, rng.randrange(1, 12))
        if not calls_of(out) and not EMPTY_BLOCK.search(text):
            assert text_of(out) == text
