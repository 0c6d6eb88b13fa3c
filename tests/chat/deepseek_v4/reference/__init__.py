"""DeepSeek's reference cases for its V4 prompt format, as data (README.md says whence)."""

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
CASES_FILE = HERE / "cases.json"
#: DeepSeek's own cases in ``deepseek/``: their number and the thinking mode their test uses.
DEEPSEEK_CASES = {1: "thinking", 2: "thinking", 3: "thinking", 4: "chat"}


def golden_output(number: int) -> str:
    return (HERE / "deepseek" / f"test_output_{number}.txt").read_text(encoding="utf-8")


def _deepseek_conversation(number: int) -> list[dict[str, Any]]:
    data = json.loads((HERE / "deepseek" / f"test_input_{number}.json").read_text("utf-8"))
    if isinstance(data, dict):  # case 1: the tools beside the messages, for the first one
        data["messages"][0]["tools"] = data["tools"]
        return list(data["messages"])
    return list(data)


def load() -> dict[str, Any]:
    """``cases.json``: ``conversations`` (DeepSeek's own added as ``deepseek-N``), and
    ``prompts`` and ``completions`` with the text the reference made of them."""
    cases: dict[str, Any] = json.loads(CASES_FILE.read_text(encoding="utf-8"))
    for number in DEEPSEEK_CASES:
        cases["conversations"][f"deepseek-{number}"] = _deepseek_conversation(number)
    return cases


def prompt_messages(cases: dict[str, Any], prompt: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a prompt case encodes: the first ``length`` of its conversation."""
    return list(cases["conversations"][prompt["conversation"]][: prompt["length"]])
