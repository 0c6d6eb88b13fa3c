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


class GrammarError(ValueError):
    """The grammar does not compile, or the output left it (a bug, never the client's)."""


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of an mlx-lm `TokenizerWrapper` (about a second for a large
    vocabulary: build it once). The engine's and the front's are built alike, so a
    grammar the front found to start (`start_problem`) starts in the engine too."""
    from llguidance.hf import from_tokenizer

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(int(t) for t in getattr(tokenizer, "eos_token_ids", ()))
    return from_tokenizer(hf, n_vocab=max(vocab_size, len(hf)), eos_token=eos or None)


def start_problem(tokenizer: Any, grammar: str) -> str | None:
    """Why ``grammar`` cannot even start under ``tokenizer`` (an `ll_tokenizer`), in
    one line; None: it can.

    Compiling is not enough: llguidance compiles a JSON schema with no finite value
    (a ``$ref`` to itself) and fails only when the first mask is computed, which in
    the engine is inside a step. So this compiles the grammar and computes that
    mask, as the engine's first step will (well under a millisecond for a JSON
    schema).
    """
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    if not matcher.is_error():
        return None
    first = str(matcher.get_error()).strip().splitlines()
    reason = first[0] if first else "unknown error"
    if reason == "NoExtensionBias":  # llguidance's stop reason: nothing can come next
        return "no text can match it (llguidance: NoExtensionBias)"
    return reason


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
