"""Write the expected text in ``cases.json`` again with DeepSeek's reference encoder.

    python -m tests.chat.deepseek_v4.reference.regenerate PATH/encoding_dsv4.py [--check]

The reference (``encoding/encoding_dsv4.py`` of the DeepSeek-V4 model repository) is
read from the path given; it is not part of this repository. To add a case, add its
conversation and a ``prompts`` entry (or a ``completions`` entry) with any expected
value, and run this. ``--check`` changes nothing and fails if a value differs.
"""

import argparse
import copy
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from tests.chat.deepseek_v4.reference import (
    CASES_FILE,
    DEEPSEEK_CASES,
    golden_output,
    load,
    prompt_messages,
)


def _reference(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("encoding_dsv4", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("encoder", type=Path, help="the reference encoding_dsv4.py")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    ref = _reference(args.encoder)
    cases = load()
    for number, mode in DEEPSEEK_CASES.items():
        messages = copy.deepcopy(cases["conversations"][f"deepseek-{number}"])
        assert ref.encode_messages(messages, thinking_mode=mode) == golden_output(number)
    for prompt in cases["prompts"]:
        prompt["expected"] = ref.encode_messages(
            copy.deepcopy(prompt_messages(cases, prompt)),
            thinking_mode=prompt["thinking_mode"],
            drop_thinking=prompt["drop_thinking"],
            reasoning_effort=prompt["reasoning_effort"],
        )
    for completion in cases["completions"]:
        parsed = ref.parse_message_from_completion_text(
            completion["text"], thinking_mode=completion["thinking_mode"]
        )
        completion["expected"] = {
            "reasoning_content": parsed["reasoning_content"],
            "content": parsed["content"],
            "tool_calls": [
                [call["function"]["name"], call["function"]["arguments"]]
                for call in parsed["tool_calls"]
            ],
        }
    for number in DEEPSEEK_CASES:
        del cases["conversations"][f"deepseek-{number}"]
    text = json.dumps(cases, ensure_ascii=False, indent=1) + "\n"
    if args.check:
        same = text == CASES_FILE.read_text(encoding="utf-8")
        print("cases.json matches the reference" if same else "cases.json differs")
        return 0 if same else 1
    CASES_FILE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
