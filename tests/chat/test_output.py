# ruff: noqa: RUF001
"""Reasoning split at ``</think>`` and tool calls read from the answer, in any split."""

import json
import random
import re

import pytest

from mlxserve.chat.deepseek_v4.dsml import DsmlParser
from mlxserve.chat.output import ChatOutput, Content, Piece, Reasoning
from mlxserve.chat.tool_calls import ParsedToolCall

CALL = (
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
    '<｜DSML｜parameter name="x" string="false">1</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)

EMPTY_BLOCK = re.compile(r"<｜DSML｜tool_calls>\s*</｜DSML｜tool_calls>")


def run(output: ChatOutput, text: str, step: int) -> list[Piece]:
    pieces: list[Piece] = []
    for i in range(0, len(text), step):
        pieces += output.push(text[i : i + step])
    return pieces + output.finish()


def joined(pieces: list[Piece], kind: type) -> str:
    return "".join(p.text for p in pieces if isinstance(p, kind))


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_thinking_answer_splits_at_the_end_marker(step: int) -> None:
    pieces = run(
        ChatOutput(reasoning_end="</think>"), "I think </thin k. So</think>Answer <b>", step
    )
    assert joined(pieces, Reasoning) == "I think </thin k. So"
    assert joined(pieces, Content) == "Answer <b>"


def test_reasoning_that_never_ends_is_all_reasoning() -> None:
    pieces = run(ChatOutput(reasoning_end="</think>"), "still thinking </thi", 3)
    assert joined(pieces, Reasoning) == "still thinking </thi"
    assert joined(pieces, Content) == ""


def test_chat_mode_is_all_content_even_with_the_marker() -> None:
    pieces = run(ChatOutput(reasoning_end=None), "a</think>b", 1)
    assert joined(pieces, Content) == "a</think>b" and joined(pieces, Reasoning) == ""


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_then_tool_call(step: int) -> None:
    output = ChatOutput(reasoning_end="</think>", tools=DsmlParser())
    pieces = run(output, "Need f.</think>\n\n" + CALL, step)
    assert joined(pieces, Reasoning) == "Need f."
    assert joined(pieces, Content) == ""
    calls = [p for p in pieces if isinstance(p, ParsedToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    assert output.tool_calls == calls and not output.malformed


def test_dsml_inside_reasoning_is_reasoning() -> None:
    output = ChatOutput(reasoning_end="</think>", tools=DsmlParser())
    pieces = run(output, CALL + "</think>ok", 2)
    assert joined(pieces, Reasoning) == CALL and joined(pieces, Content) == "ok"
    assert output.tool_calls == []


def test_random_answers_split_exactly_at_the_first_think_end() -> None:
    """Bounded fuzz: without a valid call or an empty block (which vanishes), reasoning +
    content is the text, cut at the first ``</think>``."""
    pieces = [
        "</think>",
        "</thi",
        "nk>",
        "<｜DSML｜tool_calls>",
        "</｜DSML｜tool_calls>",
        "a",
        " ",
        "\n",
    ]
    rng = random.Random(14)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 25)))
        if EMPTY_BLOCK.search(text):
            continue
        output = ChatOutput(reasoning_end="</think>", tools=DsmlParser())
        got = run(output, text, rng.randrange(1, 9))
        reasoning, _, content = text.partition("</think>")
        assert joined(got, Reasoning) == reasoning
        assert joined(got, Content) == content
        assert output.tool_calls == []
