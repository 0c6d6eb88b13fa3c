"""The model's tokenizer as the front uses it: chat template, encoding, streaming decoding.

Why in the front: validation (prompt + max_tokens within the context) must
happen before a request reaches any engine, and resuming a stream on another
backend needs the token ids already sent. The engine sees token ids only.

`FrontTokenizer`, not another wrapper: mlx-lm's ``TokenizerWrapper`` is inside, and
this adds what the front needs of it (thread-safe encoding, size bounds, grammar
checks, a continuation's detokenizer, the facts the chat formats read).
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
from pathlib import Path
from typing import Any, Protocol

from mlxserve.chat.deepseek_v4.encoding import DeepSeekRelease
from mlxserve.chat.prompt import PromptFormat
from mlxserve.chat.template import transcript
from mlxserve.errors import UsageError
from mlxserve.server.errors import InvalidRequest
from mlxserve.server.token_bound import bytes_per_token, min_tokens

#: The model types whose prompts DeepSeek's encoder builds (where there is no template).
DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v4", "deepseek_v41"})
#: DeepSeek-V4.1's architecture name in its ``config.json`` (as the fixtures write it).
V41_ARCHITECTURES = frozenset({"DeepseekV41ForCausalLM"})

#: Texts at least this long are tokenized one at a time (see `FrontTokenizer.text_ids`).
LONG_TEXT_CHARS = 1 << 20


class Detokenizer(Protocol):
    """mlx-lm's streaming detokenizer interface (what `TextStream` needs)."""

    text: str

    def add_token(self, token: int) -> None: ...
    def finalize(self) -> None: ...
    @property
    def last_segment(self) -> str: ...


class FrontTokenizer:
    def __init__(
        self,
        tokenizer: Any,
        model_type: str | None = None,
        deepseek_release: DeepSeekRelease = "v4",
    ) -> None:
        self._tokenizer = tokenizer
        self.model_type = model_type
        #: Which DeepSeek-V4 checkpoint's effort prompts the encoder writes (`_release`).
        self.deepseek_release: DeepSeekRelease = deepseek_release
        self._long_text = threading.Lock()  # one long text tokenized at a time
        self._ll: Any = None  # llguidance's tokenizer, built on the first grammar
        self._closing: Any = None  # its closing paths (`mlxserve.grammars.Closing`)
        self._ll_lock = threading.Lock()

    @classmethod
    def load(cls, model_dir: Path) -> FrontTokenizer:
        """The tokenizer of a model directory (no weights are read)."""
        from mlx_lm.utils import load_tokenizer

        if (
            not (model_dir / "tokenizer_config.json").is_file()
            and not (model_dir / "tokenizer.json").is_file()
        ):
            raise UsageError(f"{model_dir}: no tokenizer files (tokenizer.json) in the model")
        config = _config(model_dir)
        model_type = config.get("model_type")
        tokenizer = cls(
            load_tokenizer(model_dir),  # type: ignore[no-untyped-call]
            model_type if isinstance(model_type, str) else None,
            _release(model_dir, config),
        )
        _ = tokenizer.bytes_per_token  # it reads the whole vocabulary: at load, not on a request
        tokenizer.warm_up()
        return tokenizer

    def warm_up(self) -> None:
        """Do once, at load, what a first request would pay for in its time to first
        token: transformers compiles the chat template's jinja on its first use, and the
        first text through the tokenizer and the detokenizer sets them up (a first
        streamed chat took 85 ms on this CPU, later ones 30; `benchmarks/first_request.py`).
        A template that refuses a lone user message refuses it for a user too."""
        messages = [{"role": "user", "content": "Hello."}]
        try:
            ids = self.chat_ids(messages)
        except InvalidRequest:
            ids = self.text_ids("Hello.")
        detokenizer = self.detokenizer()
        for token in ids[:8]:
            detokenizer.add_token(token)
        detokenizer.finalize()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "has_chat_template", False))

    @property
    def prompt_format(self) -> PromptFormat:
        """How chat prompts are built: the model's template wins; else DeepSeek's own
        encoder for V4 and V4.1 (in V4.1's dialect: `deepseek_release`); else a plain
        transcript (base models)."""
        if self.has_chat_template:
            return "template"
        deepseek = self.model_type in DEEPSEEK_MODEL_TYPES or self.deepseek_release == "v4.1"
        return "deepseek_v4" if deepseek else "transcript"

    @property
    def think_markers(self) -> tuple[str, str] | None:
        """The template's reasoning markers (mlx-lm finds them in the vocabulary)."""
        start = getattr(self._tokenizer, "think_start", None)
        end = getattr(self._tokenizer, "think_end", None)
        return (str(start), str(end)) if start and end else None

    @property
    def tool_markers(self) -> tuple[str, str, Any] | None:
        """mlx-lm's tool-call format for this template: start and end markers and the
        parser of one call (None: mlx-lm knows no tool-call format for it)."""
        tokenizer = self._tokenizer
        if not self.has_chat_template or not getattr(tokenizer, "has_tool_calling", False):
            return None
        return (
            str(tokenizer.tool_call_start),
            str(tokenizer.tool_call_end or ""),
            (tokenizer.tool_parser),
        )

    @property
    def tool_parser_name(self) -> str | None:
        """The mlx-lm tool parser's module name (``json_tools``, ``qwen3_coder``...)."""
        markers = self.tool_markers
        module = getattr(markers[2], "__module__", "") if markers else ""
        return module.rsplit(".", 1)[-1] or None

    def template_text(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The conversation through the chat template, as text, ready for the reply."""
        try:
            text = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as exc:  # jinja's raise_exception, bad roles, ...
            raise InvalidRequest(
                f"the chat template rejected the messages: {exc}", param="messages"
            ) from None
        return str(text)

    def tokens_through(self, ids: list[int], marker: str) -> int | None:
        """How many of ``ids`` it takes for their text to contain ``marker`` (None: never)."""
        detokenizer = self.detokenizer()
        text = ""
        for count, token in enumerate(ids, start=1):
            detokenizer.add_token(token)
            text += detokenizer.last_segment
            if marker in text:
                return count
        detokenizer.finalize()
        return len(ids) if marker in text + detokenizer.last_segment else None

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def eos_token_ids(self) -> list[int]:
        return sorted(int(token) for token in self._tokenizer.eos_token_ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation through the chat template (else the transcript), ready for the reply."""
        if self.has_chat_template:
            return self.text_ids(self.template_text(list(messages)))
        return self.text_ids(transcript(messages))

    @functools.cached_property
    def bytes_per_token(self) -> float | None:
        """The most bytes of text one token can stand for (None: unknown, see `token_bound`)."""
        backend = getattr(getattr(self._tokenizer, "_tokenizer", None), "backend_tokenizer", None)
        return None if backend is None else bytes_per_token(backend)

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.text_ids(text))`` from the text's size (0: none known)."""
        return min_tokens(text, self.bytes_per_token)

    def grammar_problem(self, grammar: str) -> str | None:
        """Why ``grammar`` cannot be enforced with this tokenizer (None: it can),
        found as the engine would find it (`mlxserve.grammars.start_problem`),
        but before the request is admitted: in the engine it fails the request
        after a slot was taken, inside a step. Thread-safe (requests are prepared
        off the event loop); the first call builds llguidance's tokenizer, about a
        second for a large vocabulary."""
        from mlxserve.grammars import start_problem

        return start_problem(self._ll_tokenizer(), grammar)

    def closing_tokens(self, grammar: str, opening: list[int]) -> int | None:
        """How many tokens the answer needs at the least, as the engine counts them: the
        ``opening`` ones (a reasoning's end marker), then the engine's closing path from
        there (`mlxserve.grammars.Closing.path`: the engine reserves it before
        ``max_tokens``, so a ``max_tokens`` below it cannot be kept). None: no path is
        known (the engine then reserves none)."""
        from llguidance import LLMatcher

        from mlxserve.grammars import Closing

        tokenizer = self._ll_tokenizer()
        with self._ll_lock:
            if self._closing is None:
                self._closing = Closing(tokenizer, self.vocab_size)
            closing: Closing = self._closing
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if opening and not matcher.consume_tokens(opening):
            return None
        path = closing.path(matcher)
        return None if path is None else len(opening) + len(path)

    def _ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built on the first grammar: about a
        second for a large vocabulary, as the engine's is built)."""
        from mlxserve.grammars import ll_tokenizer

        with self._ll_lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self._tokenizer, self.vocab_size)
            return self._ll

    def text_ids(self, text: str) -> list[int]:
        """The text's token ids. Thread-safe; a long text (`LONG_TEXT_CHARS`) waits for
        any other long one: the tokenizer's working memory is about 140 times the text
        (550 MB for 3.9 MB), so two at once would double the front's peak, and what it
        freed is handed back to the system after (`release_freed_memory`)."""
        if len(text) < LONG_TEXT_CHARS:
            return self._encode(text)
        with self._long_text:
            ids = self._encode(text)
            release_freed_memory()  # the tokenizer's working memory, freed by now
        return ids

    def _encode(self, text: str) -> list[int]:
        return [int(token) for token in self._tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids)
        return text

    def detokenizer(self) -> Detokenizer:
        detokenizer: Detokenizer = self._tokenizer.detokenizer
        return detokenizer

    def continuation_detokenizer(self) -> Detokenizer:
        """A detokenizer for text that goes on from a prompt (``/v1/completions``).

        mlx-lm's detokenizers drop the first token's leading space, as a reply that
        starts a turn should; a continuation must keep it ("x" then " is" reads
        "x is", and the text must match the tokens' offsets). They trim only while
        their text is empty, so this one first reads a one-letter token and throws
        that letter away.
        """
        detokenizer = self.detokenizer()
        prime = self._prime_token()
        if prime is None:
            return detokenizer
        detokenizer.add_token(prime)
        if not detokenizer.text:  # held back (never for a plain letter): start clean
            return self.detokenizer()
        _ = detokenizer.last_segment  # the letter: not the client's text
        return detokenizer

    def _prime_token(self) -> int | None:
        """One token that decodes to a plain letter, or None if the vocabulary has none."""
        if not hasattr(self, "_prime"):
            ids = self.text_ids("a")
            self._prime = ids[0] if len(ids) == 1 and self.decode(ids).strip() == "a" else None
        return self._prime


def release_freed_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). glibc keeps what a worker thread freed in that thread's arena: after a
    long tokenization, hundreds of megabytes the front no longer uses."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc (macOS, musl)
        return None


def _config(model_dir: Path) -> dict[str, Any]:
    """The model's ``config.json`` ({} where there is none to read)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _release(model_dir: Path, config: dict[str, Any]) -> DeepSeekRelease:
    """``v4.1`` for DeepSeek-V4.1 (its ``model_type``, ``deepseek_v41``, or its
    ``architectures``: V4.1 has its own prompt dialect, whatever draft head it has);
    ``v4-0731`` for a DeepSeek-V4-Flash-0731 checkpoint: its ``config.json`` has the
    fields of its DSpark draft head (``dspark_block_size``...,
    `mlxserve.models.deepseek_v4.dspark.has_dspark_head`), or its directory's name says
    ``0731`` (a conversion that dropped the draft head, as ``...-Flash-0731-4bit``);
    else ``v4``."""
    from mlxserve.models.deepseek_v4.dspark import has_dspark_head

    architectures = config.get("architectures")
    named = set(architectures) if isinstance(architectures, list) else set()
    if config.get("model_type") == "deepseek_v41" or named & V41_ARCHITECTURES:
        return "v4.1"
    if has_dspark_head(config) or "0731" in model_dir.resolve().name:
        return "v4-0731"
    return "v4"


def model_directory(model: str, progress: bool = True) -> Path:
    """Where the model's files are: the built demo checkpoint, or the given directory."""
    if model == "demo":
        from mlxserve.models.demo import build_demo_model

        return build_demo_model(progress=progress)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise UsageError(f"model '{model}': not 'demo' and not a model directory")
    return path
