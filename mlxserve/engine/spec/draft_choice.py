"""A speculative round for a request with a `TokenChooser` (grammar, penalties, filters).

Speculation stays exact only if the drafts are checked against the distribution
the request would sample from at depth 0. So at verified position j (0..k) the
target is the chooser's transform of the main model's logits there: processors
counting the answer plus drafts[:j], the grammar's mask in its state after
drafts[:j], the log-softmax (what ``logprobs`` report), then temperature and the
filters. Greedy keeps draft j iff it is that target's argmax; sampling runs the
usual rejection test (`mlxserve.engine.sample.acceptance`) with p = that target and
q = what the draft was drawn from.

The drafts are drawn from the MTP logits under the same transforms, the grammar's
mask included, so q is the masked draft distribution and a draft is legal: the
grammar reads each draft (a host read per draft level) to give the next level,
and the verified position, its mask; unmasked drafts of structured output were
almost all rejected (on the demo, 1 kept of 51). A draft the grammar rejects
anyway (it cannot take it) stops its reading: the target there has probability 0
for it, a rejection. After the round the grammar rolls the drafts back and reads
the emitted tokens only. Without a grammar the round stays lazy: one host read.
"""

from __future__ import annotations

import mlx.core as mx

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.sample.acceptance import greedy_accept, rejection_decision
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import KeyStream, token_id


class ChosenRound:
    """The drafts of one round and their verification, for one request.

    ``remaining``: the request's budget before the round (the grammar's closing
    window counts it down per position, as depth 0 does per token).
    """

    def __init__(self, chooser: TokenChooser, remaining: int) -> None:
        self.chooser = chooser
        self.remaining = remaining
        self.drafts: list[mx.array] = []  # lazy token ids, shape ()
        self._weights: list[mx.array] = []  # per draft, the log-weights it was drawn from
        self._masks: list[mx.array] = []  # the grammar's mask at each position so far
        self._read = 0  # drafts the grammar has read (it stops at one it cannot take)
        self._stuck = False  # it met such a draft, or one that completes it

    def propose(
        self, level: int, logits: mx.array, params: SamplingParams, key: mx.array
    ) -> mx.array:
        """Draft ``level`` from the MTP logits [vocab], lazily but for the grammar's
        reading of the draft before it (`MTPAdapter.propose`'s form)."""
        chooser = self.chooser
        logprobs = chooser.target(logits, chooser.recent(self.drafts), self._mask(level))
        if chooser.params.greedy:
            token = mx.argmax(logprobs, axis=-1)
        else:
            weights = chooser.weights(logprobs)
            token = mx.random.categorical(weights, axis=-1, key=key)
            self._weights.append(weights[0])
        token = token.reshape(()).astype(mx.int32)
        self.drafts.append(token)
        return token

    def verify(self, logits: mx.array, keys: KeyStream) -> list[int]:
        """The tokens to emit, from the main logits [k + 1, vocab] of [last, drafts].

        The chooser takes them (grammar, history, logprobs of each one's target row);
        a token that completes the grammar ends them.
        """
        chooser = self.chooser
        count = len(self.drafts)
        draft_ids = mx.stack(self.drafts) if count else mx.zeros((0,), dtype=mx.int32)
        prefix: list[mx.array] | list[int] = self.drafts
        masks: list[mx.array | None] = [None] * (count + 1)
        if chooser.grammar is not None:
            self._mask(count)
            masks = list(self._masks)
            prefix = _ints(draft_ids)
            chooser.grammar.rollback(self._read)
        target = mx.concatenate(
            [
                chooser.target(logits[j], chooser.recent(prefix[:j]), masks[j])
                for j in range(count + 1)
            ]
        )
        if chooser.params.greedy:
            choice = mx.argmax(target, axis=-1)
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
            kept, final = rejection_decision(draft_ids, q, p, keys)
            mx.eval(draft_ids, kept, final)
            emitted = [*_ints(draft_ids)[: token_id(kept)], token_id(final)]
        return chooser.commit(emitted, target)

    def _mask(self, position: int) -> mx.array | None:
        """The grammar's mask at ``position``, in its state after the drafts before it
        (None: no grammar). Reads the previous draft first: a host read.

        Past a draft the grammar cannot take, or one that completes it, no position is
        emitted (the round ends there): those repeat the last mask.
        """
        grammar = self.chooser.grammar
        if grammar is None:
            return None
        while len(self._masks) <= position:
            at = len(self._masks)
            if at and not self._stuck:
                token = token_id(self.drafts[at - 1])
                if grammar.finished or grammar.allows([token]) < 1:
                    self._stuck = True
                else:
                    grammar.accept(token)
                    self._read += 1
            if self._stuck:
                self._masks.append(self._masks[-1])
            else:
                mask = self.chooser.allowed(self.remaining - at)
                assert mask is not None
                self._masks.append(mask)
        return self._masks[position]


def _ints(values: mx.array) -> list[int]:
    out = values.tolist()
    assert isinstance(out, list)
    return [int(v) for v in out]  # type: ignore[arg-type]
