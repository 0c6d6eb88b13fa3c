"""llguidance helpers shared by the front and the engine, so neither imports the other.

The front checks a request's grammar before admitting it (`start_problem`), under a
tokenizer built as the engine builds its own (`ll_tokenizer`): a grammar that starts
there starts in the engine's first step too (`mlxserve.engine.sample.grammar`). Both
find the tokens that finish a grammar the same way (`Closing`): the engine reserves
them before ``max_tokens``, the front refuses a ``max_tokens`` that cannot hold them.
"""

from __future__ import annotations

from typing import Any


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


#: The most tokens a closing path takes before it is given up (`Closing.path`).
CLOSING_LIMIT = 256
#: Tokens that start a tag's end (a call syntax's, DSML's): ``</`` first.
_TAG_STARTS = (b"</", b"<")
#: Kinds of tokens a closing path tries (`_kind`), in order; the last is never tried.
_KINDS = 9
#: From this kind on, a token repeated that changes nothing is taken for more text.
_FIRST_FILLER = 4
#: The first allowed tokens of each kind a closing path's step may try.
_PER_KIND = 3
_NEVER = (1 << 31) - 1


def _kind(text: bytes, special: bool) -> tuple[int, int]:
    """A token's kind for a closing path, and its place within it (lower first):
    brackets only (the most first), a quote alone, a quote then brackets (``"}``),
    a tag's start, a digit, another printable character, another token without
    whitespace (the shortest first), the rest; a special or empty token is never
    tried."""
    if special or not text:
        return (_KINDS - 1, 0)
    if not text.strip(b"]}"):
        return (0, -len(text))
    if text == b'"':
        return (1, 0)
    if text[:1] == b'"' and not text[1:].strip(b"]}"):
        return (2, -len(text))
    if text in _TAG_STARTS:
        return (3, _TAG_STARTS.index(text))
    if len(text) == 1 and text.isdigit():
        return (4, 0)
    if len(text) == 1 and 33 <= text[0] < 127:
        return (5, 0)
    if not any(c in b" \t\r\n" for c in text):
        return (6, len(text))
    return (7, len(text))


class Closing:
    """How a grammar is finished in few tokens, under one tokenizer (an `ll_tokenizer`).

    The front and the engine each build one (well under a second for a large
    vocabulary): the front refuses a ``max_tokens`` shorter than the path from a
    grammar's start, the engine reserves what the path from the answer so far takes
    before ``max_tokens`` runs out (`mlxserve.engine.sample.ending`), so the answer
    always parses.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import numpy as np

        count = min(vocab_size, int(tokenizer.vocab_size))
        keys = sorted(
            (*_kind(tokenizer.decode_bytes([t]), tokenizer.is_special_token(t)), t)
            for t in range(count)
        )
        #: [vocab] int32: each token's place in the order above (never tried: the most).
        self.ranks = np.full(vocab_size, _NEVER, dtype=np.int32)
        #: [vocab] int8: each token's kind (`_kind`).
        self.kinds = np.full(vocab_size, _KINDS - 1, dtype=np.int8)
        self._quote: int | None = None  # the token that is a quote alone
        for rank, (kind, _, token) in enumerate(keys):
            self.ranks[token] = rank
            self.kinds[token] = kind
            if kind == 1 and self._quote is None:
                self._quote = token
        # The tokens in rank order, and where each kind starts in it.
        self._order = np.array([token for _, _, token in keys], dtype=np.int64)
        kinds = np.array([kind for kind, _, _ in keys], dtype=np.int64)
        self._bounds = np.searchsorted(kinds, np.arange(_KINDS + 1)).tolist()

    def path(self, matcher: Any, limit: int = CLOSING_LIMIT) -> list[int] | None:
        """Tokens that take ``matcher`` (an `LLMatcher`, which they move: pass a copy) to
        a state where its grammar may end; None: none found within ``limit`` tokens.

        Short, if not always the shortest: the tokens the grammar forces (llguidance's
        fast-forward tokens: a key's name, the rest of ``true``, a call's end tag),
        else the first allowed token in `_kind`'s order (a bracket, a quote, a tag's
        start, a digit...) that is not more of the same text (`_pick`), or one after
        which the grammar may end. Free text whose end is none of those tokens (a
        reasoning's ``</think>``) has no path: its end comes first (`Grammar.closing_path`).
        """
        path: list[int] = []
        last = -1  # the token picked last
        while not (matcher.is_accepting() or matcher.is_stopped()):
            if matcher.is_error():
                return None
            tokens = [int(t) for t in matcher.compute_ff_tokens()]
            if not tokens:
                picked = self._pick(matcher, last)
                if picked is None:
                    return None
                tokens = [last := picked]
            if len(path) + len(tokens) > limit or not matcher.consume_tokens(tokens):
                return None
            path += tokens
        return None if matcher.is_error() else path

    def _pick(self, matcher: Any, last: int) -> int | None:
        """The next token of a path from ``matcher``'s state (no token forced there)."""
        import numpy as np

        mask = matcher.compute_bitmask()
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = np.zeros(self.ranks.size, dtype=np.bool_)
        allowed[: min(bits.size, allowed.size)] = bits[: allowed.size]
        ranked = np.flatnonzero(allowed[self._order])  # allowed tokens' places, in order
        candidates: list[int] = []
        for kind in range(_KINDS - 1):  # the first few of each kind, kind by kind
            at = int(np.searchsorted(ranked, self._bounds[kind]))
            places = ranked[at : at + _PER_KIND]
            candidates += [int(self._order[p]) for p in places if p < self._bounds[kind + 1]]
        quote = self._quote is not None and bool(allowed[self._quote])
        for token in candidates:
            ahead = matcher.deep_copy()
            if not ahead.consume_token(token):
                continue
            if ahead.is_accepting() or ahead.is_stopped():
                return token
            # More of the same text: the grammar allows after it just what it allowed
            # before, where a quote may come (inside a string), or it is the token picked
            # last and no bracket (``0`` after ``0.`` where the number must be above 0).
            same = ahead.compute_bitmask() == mask
            if not (same and (quote or (token == last and self.kinds[token] >= _FIRST_FILLER))):
                return token
        return None  # free text with no way out among the first tokens (a reasoning's)
