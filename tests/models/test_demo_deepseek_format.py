# ruff: noqa: RUF001
"""The DeepSeek-format demo tokenizer: DeepSeek's tokens on the demo's ids, no template."""

import json
from pathlib import Path

from mlxserve.models.demo.build import WEIGHTS_DIR
from mlxserve.models.demo.deepseek_format import RENAMED, _write_tokenizer
from mlxserve.server.tokenizer import FrontTokenizer


def test_renamed_tokens_keep_their_ids_and_the_template_is_gone(tmp_path: Path) -> None:
    _write_tokenizer(WEIGHTS_DIR, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    demo, variant = FrontTokenizer.load(WEIGHTS_DIR), FrontTokenizer.load(tmp_path)
    assert variant.vocab_size == demo.vocab_size
    assert variant.eos_token_ids == demo.eos_token_ids
    for old, new in RENAMED.items():
        assert variant.text_ids(new) == demo.text_ids(old), new
    assert not variant.has_chat_template and variant.prompt_format == "deepseek_v4"
    text = "<｜User｜>Hi<｜Assistant｜><think>"
    assert variant.decode(variant.text_ids(text)) == text
