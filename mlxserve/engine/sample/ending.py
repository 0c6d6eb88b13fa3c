"""Where a request's answer must end, in sight: its reasoning's budget, its grammar's closing.

Two rules can force a request's next token (`TokenChooser.allowed`), both from the
answer so far and the tokens left only, so a speculative round's positions get the
masks a plain step would give them there, and a batch's rows their own:

- **The thinking budget** (`Reasoning.budget_tokens`): while the reasoning the prompt
  opened is open, once only its end marker still fits in the budget, the marker's
  next token is forced, and the answer (free, or its grammar's) follows. The marker
  is recognised by its token ids, so the model may close it on its own: what it
  already wrote of it counts.
- **The grammar's closing**: a grammar's answer must parse when ``max_tokens`` runs
  out, so the tokens that finish it are reserved: from where the tokens left are no
  more than a closing path (`mlxserve.grammars.Closing.path`: the reasoning's end
  marker first while it is open) and `SLACK`, the path is forced token by token; a
  grammar that may end by then gets the model's end-of-sequence token. `SLACK` is
  how much the path may grow with the free tokens before (a key whose value is an
  object with required keys) and still be closed in time.

The paths are computed only in a request's last `horizon` tokens, from its first
path's length, so a long answer pays for them at its end only, and there at every
`EVERY`-th position of the answer (an anchor) only: a position goes by its anchor's
path until that one says the end is near, and from there by its own, which is its
parent's without the token taken (where that token was the path's first). What a
position is told depends on the answer up to it and the tokens left only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxserve.channel.request import Reasoning
from mlxserve.engine.sample.grammar import Grammar
from mlxserve.grammars import Closing

#: Tokens a closing path may grow by with the free tokens before and still close in time.
SLACK = 16
#: The horizon beyond twice the first path's length (`Ending.begin`).
HORIZON_MARGIN = 64
#: Tokens before the budget from which a speculative round computes the reasoning's
#: masks (more than any round's drafts): before that, nothing can be forced.
NEAR_BUDGET = 16
#: The positions whose paths are computed while the end is not near: every 4th.
EVERY = 4


@dataclass(frozen=True)
class Progress:
    """How far an answer has come, as its ends read it (one per position: a speculative
    round's fork moves its own)."""

    #: Tokens of the answer so far.
    tokens: int
    #: The reasoning the prompt opened is still open.
    thinking: bool
    #: Its last tokens, as many as the reasoning's end marker has.
    tail: tuple[int, ...] = ()
    #: A digest of the answer so far, and of the answer before its last token.
    key: int = 0
    parent: int = 0
    #: The answer's last token (-1: none).
    last: int = -1
    #: The digest of the answer at its last anchor (`EVERY`): the position's own where
    #: it is one.
    anchor: int = 0


class Ending:
    """One request's ends: its reasoning's end marker and budget, its grammar's closing.

    Shared by the request's chooser and its forks (a speculative round's), with the
    paths computed so far (by position); each holds its own `Progress`.
    """

    def __init__(
        self,
        reasoning: Reasoning | None,
        stop_ids: Sequence[int],
        closing: Closing | None,
        vocab_size: int,
    ) -> None:
        self.end: tuple[int, ...] = reasoning.end_ids if reasoning is not None else ()
        self.budget = reasoning.budget_tokens if reasoning is not None else None
        self.stop_ids = tuple(stop_ids)
        self.closing = closing
        self.vocab_size = vocab_size
        #: Tokens left from which the paths are computed (`begin`).
        self.horizon = HORIZON_MARGIN
        self._paths: dict[tuple[int, int], list[int] | None] = {}
        # While the reasoning is open, by how much of its end marker is written: the
        # answer's grammar starts in one state whatever the reasoning says.
        self._reasoning_paths: dict[int, list[int] | None] = {}

    def begin(self, history: Sequence[int], grammar: Grammar | None) -> Progress:
        """The progress of an answer that starts with ``history`` (a resumed request's
        tokens); sets the horizon from the path there."""
        progress = Progress(0, thinking=bool(self.end))
        for token in history:
            progress = self.after(progress, token)
        if grammar is not None and self.closing is not None:
            first = self._path(progress, grammar)
            self.horizon = HORIZON_MARGIN + 2 * len(first or ())
        return progress

    def after(self, progress: Progress, token: int) -> Progress:
        """``progress`` once ``token`` follows."""
        thinking, tail = progress.thinking, progress.tail
        if thinking:
            tail = (*tail, token)[-len(self.end) :]
            thinking = tail != self.end
        tokens, key = progress.tokens + 1, hash((progress.key, token))
        anchor = key if tokens % EVERY == 0 else progress.anchor
        return Progress(tokens, thinking, tail, key, progress.key, token, anchor)

    def near(self, progress: Progress) -> bool:
        """The reasoning's budget may force a token within `NEAR_BUDGET` positions."""
        if not progress.thinking or self.budget is None:
            return False
        return self.budget - progress.tokens <= len(self.end) + NEAR_BUDGET

    def forced(
        self, progress: Progress, grammar: Grammar | None, remaining: int | None
    ) -> int | None:
        """The token the next position must take (None: the grammar's or the model's
        choice): the reasoning's end marker at its budget, or a closing path's next
        token near ``max_tokens`` (``remaining``: the tokens left, this one included)."""
        if progress.thinking and self.budget is not None:
            done = self._matched(progress)
            if self.budget - progress.tokens <= len(self.end) - done:
                token = self.end[done]
                if grammar is None or grammar.allows([token]):
                    return token
        if grammar is None or self.closing is None or remaining is None:
            return None
        if remaining > self.horizon:
            return None
        behind = progress.tokens % EVERY  # positions since the anchor
        if behind and remaining + behind <= self.horizon:
            near = self._paths.get((progress.tokens - behind, progress.anchor))
            if near is not None and remaining > len(near) + SLACK:
                return None  # the anchor's path: the end is not near yet
        path = self._path(progress, grammar)
        if path is None or remaining > len(path) + SLACK:
            return None
        if path:
            return path[0]
        return next((t for t in self.stop_ids if grammar.allows([t])), None)

    def _matched(self, progress: Progress) -> int:
        """How much of the end marker the reasoning's last tokens already wrote."""
        for size in range(min(len(progress.tail), len(self.end) - 1), 0, -1):
            if progress.tail[-size:] == self.end[:size]:
                return size
        return 0

    def _path(self, progress: Progress, grammar: Grammar) -> list[int] | None:
        """A closing path from ``progress`` (``grammar`` in its state there): the parent
        position's without its first token where that is the token taken, else found
        anew; in the reasoning, the rest of its end marker and the answer's path, which
        depend on how much of the marker is written only."""
        assert self.closing is not None
        here = (progress.tokens, progress.key)
        if here in self._paths:
            return self._paths[here]
        before = self._paths.get((progress.tokens - 1, progress.parent))
        if before and before[0] == progress.last:
            path: list[int] | None = before[1:]
        elif progress.thinking:
            done = self._matched(progress)
            if done not in self._reasoning_paths:
                opening = self.end[done:]
                self._reasoning_paths[done] = grammar.closing_path(self.closing, opening)
            path = self._reasoning_paths[done]
        else:
            path = grammar.closing_path(self.closing)
        if len(self._paths) >= 4 * HORIZON_MARGIN:  # keep the recent positions only
            recent = progress.tokens - 4 * EVERY
            self._paths = {k: v for k, v in self._paths.items() if k[0] >= recent}
        self._paths[here] = path
        return path
