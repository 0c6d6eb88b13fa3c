"""Grammar-constrained decoding with llguidance: which tokens may come next.

One `Grammars` per engine turns the model's tokenizer into llguidance's (about a
second for a large vocabulary, so once, on the first constrained request); one
`Grammar` per request compiles its grammar, gives the mask of allowed tokens
before each sample and reads the chosen token back. The mask is a boolean MLX
array over the model's logits, applied as ``where(mask, logits, -inf)`` just
before sampling (`mlxserve.engine.sample.logits`).
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np

from mlxserve.grammars import ll_tokenizer


class GrammarError(ValueError):
    """The grammar does not compile, or the output left it (a bug, never the client's)."""


#: Characters that close a JSON string, object or array.
CLOSING = frozenset('"}]')


class Grammar:
    """One request's grammar state: mask, accept, roll back.

    ``closers`` marks the tokens made only of closing characters: near the end of its
    token budget a request prefers them where the grammar allows any (see
    `TokenChooser`), so its JSON is finished rather than cut off.
    """

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        closers: tuple[mx.array, mx.array, mx.array] | None = None,
    ) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        #: (tokens of quotes only, of closing characters only, with a newline), [vocab] bool
        self.closers = closers

    def mask(self) -> mx.array:
        """[vocab] bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")
        if allowed.size < self._vocab:
            allowed = np.pad(allowed, (0, self._vocab - allowed.size))
        self._check()
        return mx.array(allowed[: self._vocab].astype(np.bool_))

    def accept(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._check()

    def accept_all(self, tokens: list[int]) -> None:
        if tokens:
            self._matcher.consume_tokens(tokens)
            self._check()

    def rollback(self, count: int) -> None:
        """Forget the last ``count`` accepted tokens (drafts a speculative round read)."""
        if count and not self._matcher.rollback(count):
            raise GrammarError(f"grammar: cannot roll back {count} tokens")
        self._check()

    def allows(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar would take from here."""
        return int(self._matcher.validate_tokens(tokens))

    @property
    def finished(self) -> bool:
        """The grammar has matched and allows nothing more (only the end of the text)."""
        return bool(self._matcher.is_stopped())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(f"grammar: {self._matcher.get_error()}")


class Grammars:
    """Compiles grammars against the model's tokenizer (an mlx-lm `TokenizerWrapper`)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: Any = None
        self._closers: tuple[mx.array, mx.array, mx.array] | None = None
        self._lock = threading.Lock()

    def _closing_tokens(self) -> tuple[mx.array, mx.array, mx.array]:
        with self._lock:
            if self._closers is None:
                quotes = np.zeros(self.vocab_size, dtype=np.bool_)
                closing = np.zeros(self.vocab_size, dtype=np.bool_)
                newline = np.zeros(self.vocab_size, dtype=np.bool_)
                for token in range(min(self.vocab_size, len(self._tokenizer))):
                    raw = self._tokenizer.decode([token])
                    text = raw.strip()
                    quotes[token] = bool(text) and set(text) == {'"'}
                    closing[token] = bool(text) and set(text) <= CLOSING
                    newline[token] = "\n" in raw
                self._closers = (mx.array(quotes), mx.array(closing), mx.array(newline))
            return self._closers

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                self._ll = ll_tokenizer(self._tokenizer, self.vocab_size)
            return self._ll

    def compile(self, grammar: str) -> Grammar:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar: {matcher.get_error()}")
        return Grammar(matcher, self.vocab_size, self._closing_tokens())
