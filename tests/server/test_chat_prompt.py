"""Thinking controls on a chat template that has a thinking mode (``<think>`` in its vocabulary).

mlx-lm reads the markers from the vocabulary; the request's switch reaches the
template as ``enable_thinking``, and the answer is split only when the template
really opened the reasoning.
"""

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from mlxserve.models.demo.build import WEIGHTS_DIR
from mlxserve.server.chat_prompt import build_chat_prompt
from mlxserve.server.codec import Codec
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.protocol import ChatCompletionRequest

TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


@pytest.fixture(scope="module")
def thinking_codec(tmp_path_factory: pytest.TempPathFactory) -> Codec:
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
    return Codec.load(directory)


def request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    )


def test_the_switch_reaches_the_template(thinking_codec: Codec) -> None:
    assert thinking_codec.prompt_format == "template"
    assert thinking_codec.think_markers == ("<think>", "</think>")
    on = build_chat_prompt(request(thinking={"type": "enabled"}), thinking_codec, None)
    assert on.text == "<|user|>Hi<|end|><|assistant|><think>"
    assert on.reasoning_end == "</think>"
    off = build_chat_prompt(
        request(chat_template_kwargs={"enable_thinking": False}), thinking_codec, True
    )
    assert off.text == "<|user|>Hi<|end|><|assistant|>" and off.reasoning_end is None
    default_off = build_chat_prompt(request(), thinking_codec, False)
    assert default_off.reasoning_end is None
    assert on.ids == thinking_codec.text_ids(on.text)


def test_what_a_template_cannot_honour_is_refused(thinking_codec: Codec) -> None:
    for fields, param in [
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            build_chat_prompt(request(**fields), thinking_codec, None)
        assert caught.value.param == param
