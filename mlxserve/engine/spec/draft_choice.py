"""A speculative round for a request with a `TokenChooser` (grammar, penalties, filters).

Speculation stays exact only if the drafts are checked against the distribution
the request would sample from at depth 0. So at verified position j (0..k) the
target is the chooser's transform of the main model's logits there: processors
counting the answer plus drafts[:j], the grammar's mask in its state after
drafts[:j], the log-softmax (what ``logprobs`` report), then temperature and the
filters. Greedy keeps draft j iff it is that target's argmax; a seeded request
keeps it iff it is the token that position's key draws from that target, as a
plain step would (coupled draws, `mlxserve.engine.sample.acceptance`); an unseeded
one runs the usual rejection test with p = that target and q = what the draft was
drawn from.

The drafts are drawn from the MTP logits under the same transforms, the grammar's
mask included, so q is the masked draft distribution and a draft is legal: a fork
of the chooser (`TokenChooser.fork`: its grammar copied) reads each draft (a host
read per draft level) to give the next level, and the verified position, its mask;
unmasked drafts of structured output were almost all rejected (on the demo, 1 kept
of 51). A draft the grammar rejects anyway (it cannot take it) stops the fork's
reading: the target there has probability 0 for it, a rejection. The chooser
itself reads the emitted tokens only, so its grammar is never fed a token it did
not accept and never rolls back (llguidance cannot roll back past the reasoning of
a thinking request: `Grammar.fork`). Without a grammar the round stays lazy: one
host read.

A failure of the round's own work (its grammar, its transforms) is kept
(``failure``) and raised by `verify`, so rows drafting together in a batch go on
without it (`MTPRowBatch.speculate`).
"""

from __future__ import annotations

import mlx.core as mx

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.sample.acceptance import greedy_accept, rejection_decision
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import Draws, pick, token_id


class ChosenRound:
    """The drafts of one round and their verification, for one request.

    ``remaining``: the request's budget before the round (a grammar's closing counts
    it down per position, as depth 0 does per token: `mlxserve.engine.sample.ending`).
    """

    def __init__(self, chooser: TokenChooser, remaining: int) -> None:
        self.chooser = chooser
        self.remaining = remaining
        self.drafts: list[mx.array] = []  # lazy token ids, shape ()
        self.failure: Exception | None = None
        self._weights: list[mx.array] = []  # per draft, the log-weights it was drawn from
        self._masks: list[mx.array | None] = []  # the mask at each position so far
        # Its positions may have masks: a grammar, or a thinking budget in sight.
        self._masked = chooser.masked
        self._reader: TokenChooser | None = None  # the fork that reads the drafts
        self._stuck = False  # it met a draft it cannot take, or one that completes it

    def propose(
        self, level: int, logits: mx.array, params: SamplingParams, key: mx.array
    ) -> mx.array:
        """Draft ``level`` from the MTP logits [vocab] with its position's ``key``, lazily
        but for the grammar's reading of the draft before it (`MTPAdapter.propose`'s
        form). After a failure, a stand-in the round never emits."""
        token = mx.array(0, dtype=mx.int32)
        if self.failure is None:
            try:
                token = self._propose(level, logits, key)
            except Exception as exc:  # the row's own: its verify raises it
                self.failure = exc
        self.drafts.append(token)
        return token

    def _propose(self, level: int, logits: mx.array, key: mx.array) -> mx.array:
        chooser = self.chooser
        if self._masked:
            # The level's forward runs while the host reads the draft before it (queued
            # on its own below, so that read waits for it alone) and makes the mask.
            mx.async_eval(logits)  # type: ignore[no-untyped-call]
        logprobs = chooser.target(logits, chooser.recent(self.drafts), self._mask(level))
        if chooser.params.greedy:
            token = mx.argmax(logprobs, axis=-1)
        else:
            weights = chooser.weights(logprobs)
            token = pick(weights, key)
            self._weights.append(weights[0])
        token = token.reshape(()).astype(mx.int32)
        if self._masked:
            mx.async_eval(token)  # type: ignore[no-untyped-call]
        return token

    def truncate(self, count: int) -> None:
        """Verify only the first ``count`` drafts (a DSpark round's adaptive verification:
        `mlxserve.engine.spec.dspark`); the masks past them are never read."""
        self.drafts = self.drafts[:count]
        self._weights = self._weights[:count]
        self._masks = self._masks[: count + 1]

    def verify(self, logits: mx.array, draws: Draws) -> list[int]:
        """The tokens to emit, from the main logits [k + 1, vocab] of [last, drafts]
        (``draws``: the keys of the round's positions).

        The chooser takes them (grammar, history, logprobs of each one's target row);
        a token that completes the grammar ends them.
        """
        if self.failure is not None:
            raise self.failure
        chooser = self.chooser
        count = len(self.drafts)
        draft_ids = mx.stack(self.drafts) if count else mx.zeros((0,), dtype=mx.int32)
        prefix: list[mx.array] | list[int] = self.drafts
        masks: list[mx.array | None] = [None] * (count + 1)
        if self._masked:
            self._mask(count)
            masks = list(self._masks)
            prefix = _ints(draft_ids)
        target = mx.concatenate(
            [
                chooser.target(logits[j], chooser.recent(prefix[:j]), masks[j])
                for j in range(count + 1)
            ]
        )
        if chooser.params.greedy or draws.coupled:
            if chooser.params.greedy:
                choice = mx.argmax(target, axis=-1)
            else:
                choice = draws.pick(chooser.weights(target))
            mx.eval(draft_ids, choice)
            emitted = greedy_accept(_ints(draft_ids), _ints(choice))
        else:
            vocab = int(target.shape[-1])
            q = (
                mx.softmax(mx.stack(self._weights), axis=-1)
                if count
                else mx.zeros((0, vocab), dtype=mx.float32)
            )
            p = mx.softmax(chooser.weights(target), axis=-1)
            kept, final = rejection_decision(draft_ids, q, p, draws)
            mx.eval(draft_ids, kept, final)
            emitted = [*_ints(draft_ids)[: token_id(kept)], token_id(final)]
        return chooser.commit(emitted, target)

    def _mask(self, position: int) -> mx.array | None:
        """The mask at ``position`` (`TokenChooser.allowed`: the grammar's, or a token an
        end forces), in the state after the drafts before it (None: anything), from
        the fork that reads them. Reads the previous draft first: a host read.

        Past a draft the grammar cannot take, or one that completes it, no position is
        emitted (the round ends there): those repeat the last mask.
        """
        if not self._masked:
            return None
        if self._reader is None:
            self._reader = self.chooser.fork()
        reader = self._reader
        grammar = reader.grammar
        while len(self._masks) <= position:
            at = len(self._masks)
            if at and not self._stuck:
                token = token_id(self.drafts[at - 1])
                if reader.finished or (grammar is not None and grammar.allows([token]) < 1):
                    self._stuck = True
                else:
                    reader.read(token)
            if self._stuck:
                self._masks.append(self._masks[-1])
            else:
                self._masks.append(reader.allowed(self.remaining - at))
        return self._masks[position]


def _ints(values: mx.array) -> list[int]:
    out = values.tolist()
    assert isinstance(out, list)
    return [int(v) for v in out]  # type: ignore[arg-type]
