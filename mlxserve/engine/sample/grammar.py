"""Grammar-constrained decoding with llguidance: which tokens may come next.

One `Grammars` per engine turns the model's tokenizer into llguidance's (about a
second for a large vocabulary, so once, on the first constrained request); one
`Grammar` per request compiles its grammar, gives the mask of allowed tokens
before each sample and reads the chosen token back: only the tokens the request
emits (a speculative round reads its drafts into a `Grammar.fork`). The mask is a
boolean MLX array over the model's logits, applied as ``where(mask, logits, -inf)``
just before sampling (`mlxserve.engine.sample.logits`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlxserve.grammars import Closing, ll_tokenizer


class GrammarError(ValueError):
    """The grammar does not compile, or the output left it (a bug, never the client's)."""


class Grammar:
    """One request's grammar state: mask, accept, fork, and the tokens that finish it
    (`closing_path`: near ``max_tokens`` they are reserved, `mlxserve.engine.sample.ending`)."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size

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

    def fork(self) -> Grammar:
        """A copy in the same state that reads tokens on its own (a speculative round's
        drafts: about a microsecond). Not a rollback: llguidance refuses to roll back
        past a lexeme with ``stop=`` or ``max_tokens=`` (the reasoning before a thinking
        request's answer, `mlxserve.server.constraints.after_reasoning`), and a refused
        rollback leaves the matcher in its error state for good."""
        return Grammar(self._matcher.deep_copy(), self._vocab)

    def allows(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar would take from here."""
        return int(self._matcher.validate_tokens(tokens))

    def closing_path(self, closing: Closing, opening: Sequence[int] = ()) -> list[int] | None:
        """Tokens that finish the grammar from here: ``opening`` (which it must take),
        then `Closing.path`'s (None: none found). The grammar itself does not move."""
        matcher = self._matcher.deep_copy()
        if opening and not matcher.consume_tokens(list(opening)):
            return None
        path = closing.path(matcher)
        return None if path is None else [*opening, *path]

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
        self._closing: Closing | None = None
        self._lock = threading.Lock()

    def closing(self) -> Closing:
        """The tokenizer's closing paths (built on first use)."""
        tokenizer = self._ll_tokenizer()
        with self._lock:
            if self._closing is None:
                self._closing = Closing(tokenizer, self.vocab_size)
            return self._closing

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
        return Grammar(matcher, self.vocab_size)
