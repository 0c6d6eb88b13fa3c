"""One request's token choice when it needs more than temperature and top_p.

The order is fixed: logit processors (``logit_bias``, repetition, presence and
frequency penalties: mlx-lm's) change the logits; the grammar's mask removes the
tokens it does not allow; the log-softmax of that is what ``logprobs`` report;
then temperature, min_p, top_k and top_p (mlx-lm's filters) shape the
distribution the token is drawn from with the request's own random key.

Such requests decode wherever others do, pipelined as plain rows are: a step
draws a row's next token lazily (`draw_next`: the mask is made on the host from the
tokens already taken, while the forward runs), queues the forward that feeds it,
and only then reads the token and `take`s it (`Runner._step`). In a speculative round
the same transforms make both distributions (`mlxserve.engine.spec.draft_choice`):
the drafts are drawn from the transformed draft logits, and each verified
position's target is the transformed main logits, with the history extended by
the drafts before it and the grammar in its state after them.

Near an end a position may have one choice only: the reasoning's end marker at its
thinking budget, the tokens that finish the grammar before ``max_tokens``
(`mlxserve.engine.sample.ending`); those masks depend on the answer so far and the
tokens left only, so a speculative round's positions get them as plain steps would.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlxserve.channel.request import SamplingParams, TokenLogprob
from mlxserve.engine.sample.ending import Ending
from mlxserve.engine.sample.grammar import Grammar
from mlxserve.engine.sample.sampling import pick, token_id

#: How many recent tokens the penalties look at (mlx-lm's default is 20; OpenAI's
#: penalties count the whole answer, so the window is wide).
PENALTY_CONTEXT = 1024

#: What a token the mask or a filter removed reports (JSON has no -inf), as vLLM does.
LOGPROB_FLOOR = -9999.0


def _finite(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class TokenChooser:
    def __init__(
        self,
        params: SamplingParams,
        grammar: Grammar | None,
        history: tuple[int, ...] = (),
        ending: Ending | None = None,
    ) -> None:
        self.params = params
        self.grammar = grammar
        #: The request's ends (its reasoning's budget, its grammar's closing), if any.
        self.ending = ending
        bias = dict(params.logit_bias) or None
        self._processors = make_logits_processors(
            logit_bias=bias,
            repetition_penalty=params.repetition_penalty
            if params.repetition_penalty != 1
            else None,
            repetition_context_size=PENALTY_CONTEXT,
            presence_penalty=params.presence_penalty or None,
            presence_context_size=PENALTY_CONTEXT,
            frequency_penalty=params.frequency_penalty or None,
            frequency_context_size=PENALTY_CONTEXT,
        )
        # The answer's tokens the penalties count: a resumed request's earlier ones too.
        self.history: list[int] = list(history)
        #: Log-probabilities of the tokens chosen since the engine last took them.
        self.logprobs: list[TokenLogprob] = []
        if grammar is not None:
            grammar.accept_all(list(history))
        self._complete = grammar is not None and grammar.finished
        self.progress = ending.begin(history, grammar) if ending is not None else None
        # What `draw_next` drew the token due next from: its `target` row when logprobs
        # are asked for (else None), or the failure `take` raises.
        self._due: mx.array | Exception | None = None

    def choose(self, logits: mx.array, key: mx.array, remaining: int | None = None) -> int:
        """The next token from ``logits`` ([vocab]); records it (grammar, history, logprobs).

        ``remaining``: tokens left in the request's budget (see `allowed`).
        """
        token = token_id(self.draw_next(logits, key, remaining))
        self.take(token)
        return token

    def draw_next(self, logits: mx.array, key: mx.array, remaining: int | None = None) -> mx.array:
        """The next token from ``logits`` ([vocab]), lazily ([], uint32): the mask is made
        now, from the tokens taken so far, so only the draw waits for the logits. Nothing
        is recorded until `take` reads it back; another token may not be drawn before.

        A failure here (its grammar) is kept and raised by that `take`: the position
        fails when its token is due, as `choose` there would (the stand-in returned is
        fed to no step that emits)."""
        try:
            logprobs = self.target(logits, self.recent(), self.allowed(remaining))
            token = self.draw(logprobs, key)[0]
        except Exception as exc:
            self._due = exc
            return mx.array(0, dtype=mx.uint32)
        self._due = logprobs if self.params.logprobs is not None else None
        return token

    def take(self, token: int) -> None:
        """``token``, the value of the last `draw_next`, follows: recorded as `commit`
        records it (raises that draw's failure, or the grammar's refusal)."""
        due, self._due = self._due, None
        if isinstance(due, Exception):
            raise due
        self.commit([token], due)

    def recent(self, drafts: Sequence[mx.array | int] = ()) -> mx.array:
        """The tokens the penalties count: the answer's last ones, then ``drafts`` (ints,
        or lazy tokens of a speculative round). Empty when no processor reads them."""
        if not self._processors:
            return mx.array([], dtype=mx.int32)
        parts = [mx.array(self.history[-PENALTY_CONTEXT:], dtype=mx.int32)]
        for draft in drafts:
            parts.append(
                draft.reshape(1).astype(mx.int32)
                if isinstance(draft, mx.array)
                else mx.array([draft], dtype=mx.int32)
            )
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    def target(self, logits: mx.array, recent: mx.array, allowed: mx.array | None) -> mx.array:
        """Log-probabilities [1, vocab] after the processors (penalties counting ``recent``)
        and the mask ``allowed``: what ``logprobs`` report, and greedy's argmax."""
        scores = logits.astype(mx.float32).reshape(1, -1)
        for processor in self._processors:
            scores = processor(recent, scores)
        if allowed is not None:
            scores = mx.where(allowed, scores, -math.inf)
        return scores - mx.logsumexp(scores, axis=-1, keepdims=True)

    def allowed(self, remaining: int | None) -> mx.array | None:
        """[vocab] bool: what may come next (None: anything): what the grammar allows in
        its current state, or the one token an end forces (`Ending.forced`: the
        reasoning's end marker at its budget, a closing path near ``max_tokens``).

        ``remaining``: tokens left in the request's budget, this one included.
        """
        forced = None
        if self.ending is not None:
            assert self.progress is not None
            forced = self.ending.forced(self.progress, self.grammar, remaining)
        if forced is not None:
            assert self.ending is not None
            return mx.arange(self.ending.vocab_size) == forced
        return self.grammar.mask() if self.grammar is not None else None

    @property
    def masked(self) -> bool:
        """Its positions may have masks (`allowed`) within a speculative round from here:
        a grammar, or a thinking budget in sight (`Ending.near`)."""
        if self.grammar is not None:
            return True
        return (
            self.ending is not None
            and self.progress is not None
            and self.ending.near(self.progress)
        )

    def weights(self, logprobs: mx.array) -> mx.array:
        """Log-weights [..., vocab] of the distribution a sampled token is drawn from:
        temperature, then min_p, top_k and top_p (filtered tokens at -inf)."""
        params = self.params
        scaled = logprobs / params.temperature
        if params.min_p > 0:
            scaled = apply_min_p(scaled, params.min_p)
        if 0 < params.top_k < scaled.shape[-1]:
            scaled = apply_top_k(scaled, params.top_k)
        if params.top_p < 1:
            scaled = apply_top_p(scaled, params.top_p)
        return scaled

    def draw(self, logprobs: mx.array, key: mx.array) -> mx.array:
        """One token per row of ``logprobs`` (from `target`), lazily, drawn with ``key``
        (`mlxserve.engine.sample.sampling.pick`: a speculative round draws the same)."""
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        return pick(self.weights(logprobs), key)

    def commit(self, tokens: list[int], logprobs: mx.array | None) -> list[int]:
        """The chosen ``tokens``, in order, with the `target` rows they were chosen from
        (``logprobs`` [n, vocab]; None only where no logprobs are asked for): the grammar
        reads them, the history and the logprobs record them. Stops after a token that
        completes the grammar (nothing may follow it); returns the tokens taken."""
        taken: list[int] = []
        for row, token in enumerate(tokens):
            if self.params.logprobs is not None:
                assert logprobs is not None
                self.logprobs.append(self._record(logprobs[row], token))
            self.read(token)
            taken.append(token)
            if self.finished:
                break
        return taken

    def read(self, token: int) -> None:
        """``token`` follows: the grammar takes it, the history and the ends count it. Every state
        a token moves (here) must be copied by `fork`."""
        if self.grammar is not None:
            self.grammar.accept(token)
            self._complete = self.grammar.finished
        if self.ending is not None:
            assert self.progress is not None
            self.progress = self.ending.after(self.progress, token)
        self.history.append(token)

    @property
    def finished(self) -> bool:
        """Its grammar is complete: nothing may follow. As the last token read left it:
        a mask made since (`draw_next`'s, for a token not yet taken) that found no way
        on stops the matcher too, but that is the next position's failure."""
        return self._complete

    def fork(self) -> TokenChooser:
        """A copy whose state moves on its own (a speculative round reads its drafts into
        one, so this chooser only ever reads the tokens emitted): the grammar's matcher
        copied, the history too; no logprobs."""
        twin = copy.copy(self)
        twin.grammar = self.grammar.fork() if self.grammar is not None else None
        twin.history = list(self.history)
        twin.logprobs = []
        twin._due = None
        return twin

    def _record(self, logprobs: mx.array, token: int) -> TokenLogprob:
        count = self.params.logprobs or 0
        top: tuple[tuple[int, float], ...] = ()
        if count:
            ids = mx.argsort(-logprobs)[:count]
            values = logprobs[ids].tolist()
            assert isinstance(values, list)
            top = tuple(
                (int(i), _finite(float(v)))  # type: ignore[arg-type]
                for i, v in zip(ids.tolist(), values, strict=True)  # type: ignore[arg-type]
            )
        chosen = logprobs[token].item()
        assert isinstance(chosen, float)
        return TokenLogprob(token, _finite(chosen), top)

    def take_logprobs(self, count: int) -> tuple[TokenLogprob, ...] | None:
        """The records of the next ``count`` emitted tokens (None: none were asked for)."""
        if self.params.logprobs is None:
            return None
        taken, self.logprobs = self.logprobs[:count], self.logprobs[count:]
        return tuple(taken)
