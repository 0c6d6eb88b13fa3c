"""Thinking controls on a chat template that has a thinking mode (``<think>`` in its vocabulary).

mlx-lm reads the markers from the vocabulary; the request's switch reaches the
template as ``enable_thinking``, and the answer is split only when the template
really opened the reasoning.
"""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer

from mlxserve.chat import ChatRequest, Function, Message, Refused, TemplateKwargs, build_prompt
from mlxserve.models.demo.build import WEIGHTS_DIR
from mlxserve.server.tokenizer import FrontTokenizer

TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> FrontTokenizer:
    directory: Path = tmp_path_factory.mktemp("thinking-template")
    tokenizer = Tokenizer.from_file(str(WEIGHTS_DIR / "tokenizer.json"))
    tokenizer.add_tokens(
        [AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    shutil.copyfile(WEIGHTS_DIR / "tokenizer_config.json", directory / "tokenizer_config.json")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return FrontTokenizer.load(directory)


def request(**fields: Any) -> ChatRequest:
    return ChatRequest((Message("user", "Hi"),), **fields)


def test_the_switch_reaches_the_template(thinking_tokenizer: FrontTokenizer) -> None:
    assert thinking_tokenizer.prompt_format == "template"
    assert thinking_tokenizer.think_markers == ("<think>", "</think>")
    on = build_prompt(request(thinking=True), thinking_tokenizer, None)
    assert on.text == "<|user|>Hi<|end|><|assistant|><think>"
    assert on.reasoning_end == "</think>"
    off = build_prompt(
        request(chat_template_kwargs=TemplateKwargs(enable_thinking=False)),
        thinking_tokenizer,
        True,
    )
    assert off.text == "<|user|>Hi<|end|><|assistant|>" and off.reasoning_end is None
    default_off = build_prompt(request(), thinking_tokenizer, False)
    assert default_off.reasoning_end is None
    assert on.ids == thinking_tokenizer.text_ids(on.text)


def test_what_a_template_cannot_honour_is_refused(thinking_tokenizer: FrontTokenizer) -> None:
    for fields, param in [
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"tools": (Function("f"),)}, "tools"),
    ]:
        with pytest.raises(Refused) as caught:
            build_prompt(request(**fields), thinking_tokenizer, None)
        assert caught.value.param == param
