# ruff: noqa: RUF001, RUF002
"""The demo checkpoint dressed as the published DeepSeek-V4: its special tokens, no template.

The published DeepSeek-V4 ships no chat template, so the server builds its prompts
with DeepSeek-V4's own encoder. To drive that path end to end (real server, real
forward), this variant keeps the demo's weights and token ids and renames the
demo's special tokens to DeepSeek's: ``<|bos|>`` becomes ``<｜begin▁of▁sentence｜>``,
``<|user|>`` ``<｜User｜>``, ``<|assistant|>`` ``<｜Assistant｜>`` and the EOS ``<|end|>``
``<｜end▁of▁sentence｜>``. The vocabulary size stays 1024, so nothing is retrained;
``<think>``, ``</think>`` and the DSML markers are ordinary text to this tokenizer,
which the server reads as text anyway. The model was not trained on this format, so
its answers are its demo answers, not DeepSeek's behaviour.

The weights and ``config.json`` are in DeepSeek's published layout too (``embed.weight``,
``layers.N.attn.kv_norm.weight``, one tensor per expert...; its HCA ratio 16 is not
one ``compress_ratios`` may say, so the config keeps ``layer_types``; see
``deepseek_v4/publish.py``), written from the loaded demo with its quantised experts
dequantised to float32, so the same function is computed; the checkpoint thus also
exercises the loader's reading of the published names end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxserve.chat.deepseek_v4.encoding import ASSISTANT, BOS, EOS, USER

from .build import MARKER, build_demo_model, build_once

#: The demo's special tokens and the DeepSeek-V4 tokens that take over their ids.
RENAMED = {
    "<|bos|>": BOS,
    "<|user|>": USER,
    "<|assistant|>": ASSISTANT,
    "<|end|>": EOS,
    "<|pad|>": "<｜▁pad▁｜>",
}
SUFFIX = "-deepseek-format"
#: Bump when this variant's output changes for the same demo build (2: published layout).
VARIANT_VERSION = "3"


def _rename(value: Any) -> Any:
    if isinstance(value, str):
        return RENAMED.get(value, value)
    if isinstance(value, list):
        return [_rename(item) for item in value]
    return value


def _write_tokenizer(source: Path, target: Path) -> None:
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    for token in tokenizer["added_tokens"]:
        token["content"] = _rename(token["content"])
    vocab = tokenizer["model"]["vocab"]
    tokenizer["model"]["vocab"] = {_rename(key): value for key, value in vocab.items()}
    (target / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config = {key: _rename(value) for key, value in config.items()}
    (target / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    )


def _write_published_weights(source: Path, target: Path) -> None:
    """The demo's weights and config in DeepSeek's published names and spelling."""
    import mlx.core as mx

    from ..deepseek_v4.publish import published_config, published_weights
    from ..loader import load_model

    model, config = load_model(source, memory_bytes=0)
    weights = published_weights(model)
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "pt"})
    tokens: dict[str, Any] = {
        key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config
    }
    published = published_config(model.args, tokens)
    (target / "config.json").write_text(json.dumps(published, indent=2, sort_keys=True) + "\n")


def build_deepseek_format_demo(out_dir: Path | None = None, progress: bool = True) -> Path:
    """Build (or reuse) the variant next to the demo build; return its directory."""
    base = build_demo_model(progress=progress)
    digest = f"{(base / MARKER).read_text().strip()}{SUFFIX}-{VARIANT_VERSION}"
    target = Path(out_dir) if out_dir is not None else base.with_name(base.name + SUFFIX)

    def write(tmp: Path) -> None:
        _write_published_weights(base, tmp)
        _write_tokenizer(base, tmp)

    return build_once(target, digest, write)
