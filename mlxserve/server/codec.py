"""Tokenizer work done in the front: chat template, encoding, streaming decoding.

Why in the front: validation (prompt + max_tokens within the context) must
happen before a request reaches any engine, and resuming a stream on another
backend needs the token ids already sent. The engine sees token ids only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from mlxserve.errors import UsageError
from mlxserve.server.errors import InvalidRequest


class Detokenizer(Protocol):
    """mlx-lm's streaming detokenizer interface (what `TextStream` needs)."""

    def add_token(self, token: int) -> None: ...
    def finalize(self) -> None: ...
    @property
    def last_segment(self) -> str: ...


class Codec:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def load(cls, model_dir: Path) -> Codec:
        """The tokenizer of a model directory (no weights are read)."""
        from mlx_lm.utils import load_tokenizer

        if (
            not (model_dir / "tokenizer_config.json").is_file()
            and not (model_dir / "tokenizer.json").is_file()
        ):
            raise UsageError(f"{model_dir}: no tokenizer files (tokenizer.json) in the model")
        return cls(load_tokenizer(model_dir))  # type: ignore[no-untyped-call]

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(int(token) for token in self._tokenizer.eos_token_ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the model's chat template, ready for the reply."""
        if getattr(self._tokenizer, "has_chat_template", False):
            try:
                ids = self._tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True
                )
            except Exception as exc:  # jinja's raise_exception, bad roles, ...
                raise InvalidRequest(
                    f"the chat template rejected the messages: {exc}", param="messages"
                ) from None
            return [int(token) for token in ids]
        # No template: a plain transcript, so base models still answer something.
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.text_ids(text)

    def text_ids(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return [int(token) for token in ids]

    def decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids)
        return text

    def detokenizer(self) -> Detokenizer:
        detokenizer: Detokenizer = self._tokenizer.detokenizer
        return detokenizer


def model_directory(model: str, progress: bool = True) -> Path:
    """Where the model's files are: the built demo checkpoint, or the given directory."""
    if model == "demo":
        from mlxserve.models.demo import build_demo_model

        return build_demo_model(progress=progress)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise UsageError(f"model '{model}': not 'demo' and not a model directory")
    return path
