"""Run one step on the model and turn the result into tokens per request.

Plain decoding is pipelined like `mlx_lm.generate`: the next forward is
queued (`mx.async_eval`) before the current token is read back, so the host
and the device overlap. Decoding requests run in decode batches that live
across steps (`mlxserve.engine.runner.batch`): a request joins its batch when its
prompt is done (its prefilled state inserted) and leaves it when it finishes
(`settle`), between any two steps; a step is one forward per batch and no
copy of the batch. Speculative steps are delegated to the adapter.

A request with a `TokenChooser` (grammar, penalties, logprobs...) decodes in the
same batches and rounds, pipelined too: once a step's forward is queued, its
row reads the token it drew last step, the chooser takes it (grammar, ends,
history, logprobs), and the mask of the next position is made on the host from
there while the forward runs; the next token is drawn lazily under it and fed to
the next step before it is read (`TokenChooser.draw_next`, `take`). So such a row
holds a drawn, untaken token in ``pending`` (or its batch's next input) as plain
rows hold a sampled one, and whoever emits that token takes it first; no mask is
made after a token that ends the request (a stop token, the grammar complete, the
budget spent). Its speculative rounds verify under its transforms
(`engine.draft_choice`). Where its choice fails (its grammar...), the request
fails alone (``failed``) when the failing position's token is due: the other rows
of the step go on.

Every token is drawn with its position's key (`RequestState.key`), so which step
draws it (alone, batched, pipelined or in a round) does not change it.
"""

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.core.prefix_cache import PrefixCache
from mlxserve.engine.core.request_state import Phase, RequestState
from mlxserve.engine.core.step import Step
from mlxserve.engine.runner.adapter import (
    ModelAdapter,
    ModelState,
    SupportsReserve,
    SupportsSpeculation,
)
from mlxserve.engine.runner.batch import DecodeBatch, MTPRowBatch, can_join, new_batch
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.rows import sample_rows
from mlxserve.engine.sample.sampling import sample, token_id
from mlxserve.engine.spec.depth import DepthPicker

log = logging.getLogger(__name__)

#: The sampling of a row whose chooser drew its token: greedy, its result unused.
_UNUSED = SamplingParams()

#: finish reasons after which a request's final state is worth keeping for reuse
_REUSABLE = ("stop", "length")


@dataclass
class _Batch:
    """A decode batch and the sequences of its rows, in row order."""

    state: DecodeBatch
    rows: list[RequestState]
    # The next input token of every row ([B], lazy) while membership is unchanged.
    tokens: mx.array | None = None


class Runner:
    def __init__(self, adapter: ModelAdapter, prefix_cache: PrefixCache | None) -> None:
        self.adapter = adapter
        self.prefix_cache = prefix_cache
        self.batches: list[_Batch] = []
        self._batch_of: dict[str, _Batch] = {}
        # Set by the engine when a request chooses its depth per round, with the
        # clock that times rounds on this device (`mlxserve.hardware.clock`).
        self.depth_picker: DepthPicker | None = None
        # Requests given a state and not yet released: the rows a batch may soon hold.
        self._live: set[str] = set()
        self.clock: Callable[[], float] = time.perf_counter
        # The requests of the last decode or speculative step and when it ended: the
        # time until their next step starts is the engine's own, which the depth picker
        # adds to every step's cost (`DepthPicker.overhead`).
        self._last_step: tuple[tuple[str, ...], float] | None = None
        #: The requests whose own token choice failed in the last step, with the error:
        #: they emit nothing from it, and the engine finishes them with that error.
        self.failed: dict[str, str] = {}
        # Finished requests' final states, stored at the next `keep_finished`.
        self._finished: list[tuple[RequestState, ModelState]] = []

    def run(self, step: Step, sequences: list[RequestState]) -> dict[str, list[int]]:
        """Execute `step`; returns the tokens each request emits in this step (not
        those in ``failed``)."""
        self.failed = {}
        stepping = step.kind != "prefill"
        # Taken, not read: a step that fails leaves no start for the next gap.
        last, self._last_step = self._last_step, None
        if self.depth_picker is not None and stepping and last is not None:
            served, ended = last
            if served == tuple(step.request_ids):
                self.depth_picker.observe_between(self.clock() - ended)
        emitted: dict[str, list[int]] = {}
        if step.kind == "decode":
            emitted = self._decode_all(sequences)
        elif step.kind == "speculate" and len(sequences) > 1:
            emitted = self._speculate_all(sequences, step.num_tokens)
        for sequence in sequences:
            if step.kind == "prefill":
                self._prefill(sequence, step.num_tokens)
            elif step.kind == "speculate" and len(sequences) == 1:
                emitted[sequence.request_id] = self._speculate(sequence, step.num_tokens)
        for sequence in sequences:
            if sequence.request_id in self.failed:
                emitted.pop(sequence.request_id, None)
            sequence.transcript.extend(emitted.get(sequence.request_id, ()))
        if stepping and self.depth_picker is not None:  # only an automatic depth reads it
            self._last_step = (tuple(step.request_ids), self.clock())
        return emitted

    def forget_last_step(self) -> None:
        """The next step starts no gap: what ran since the last one was not the
        engine's usual work between steps (a calibration, which also changes `clock`)."""
        self._last_step = None

    @property
    def batched(self) -> int:
        """Requests decoding inside a batch now."""
        return len(self._batch_of)

    def attach_state(self, sequence: RequestState) -> None:
        """Give a starting request its model state: a prefix-cache hit or a fresh one."""
        if sequence.state is not None:
            return
        self._live.add(sequence.request_id)
        hit = self.prefix_cache.lookup(sequence.prompt) if self.prefix_cache else None
        if hit is not None:
            sequence.state, sequence.prefilled = hit
            sequence.cached_tokens = sequence.prefilled
        else:
            margin = max(sequence.depth, sequence.rollback)
            sequence.state = self.adapter.new_state(max_rollback=margin)
        if isinstance(self.adapter, SupportsReserve):
            # The prompt's caches are allocated once, for the whole prompt.
            self.adapter.reserve(sequence.state, len(sequence.prompt))

    def settle(self) -> None:
        """Take finished (or cancelled) requests out of their batches, between steps.

        A request that finished normally leaves its final state to the prefix cache
        (the prompt and every token it generated): the next turn of a conversation,
        whose prompt extends this one's with the answer, starts from it.
        """
        for batch in list(self.batches):
            gone = [i for i, s in enumerate(batch.rows) if s.phase is Phase.FINISHED]
            if gone:
                self._remove(batch, gone, finished=True)

    def release(self, sequence: RequestState) -> int:
        """A request finished: its share of the cache bytes; outside any batch, its
        final state is kept for reuse now (batched rows leave in ``settle``)."""
        self._live.discard(sequence.request_id)
        if self._last_step is not None and sequence.request_id in self._last_step[0]:
            # The same id may come back later (a caller's own ids, a prefix-cache hit
            # that needs no prefill): the wait in between is not the engine's.
            self._last_step = None
        batch = self._batch_of.get(sequence.request_id)
        if batch is not None:
            return batch.state.nbytes() // max(len(batch.rows), 1)
        if sequence.state is None:
            return 0
        nbytes = self.adapter.nbytes(sequence.state)
        if self.prefix_cache is not None and sequence.finish_reason in _REUSABLE:
            self._keep_final(sequence, sequence.state)
        return nbytes

    # -- prefill -------------------------------------------------------------

    def _prefill(self, sequence: RequestState, count: int) -> None:
        assert sequence.state is not None
        count = min(count, sequence.prompt_remaining)
        start = sequence.prefilled
        self.adapter.prefill(sequence.state, list(sequence.prompt[start : start + count]))
        sequence.prefilled += count

    def _first_logits(self, sequence: RequestState) -> mx.array:
        """Run the last prompt token; the state is stored for prefix reuse just before."""
        assert sequence.state is not None
        if self.prefix_cache is not None and sequence.prefilled > sequence.cached_tokens:
            self.prefix_cache.store(sequence.prompt[: sequence.prefilled], sequence.state)
        sequence.phase = Phase.DECODE
        return self.adapter.step(sequence.state, mx.array(sequence.prompt[-1:]))

    # -- decode ----------------------------------------------------------------

    def _decode(self, sequence: RequestState) -> list[int]:
        """One request's own decode step (its first token, or no batch fits it)."""
        if sequence.chooser is not None:
            return self._choose(sequence, sequence.chooser)
        params = sequence.request.params.sampling
        first: int | None = None
        if sequence.pending is None:
            sequence.pending = sample(self._first_logits(sequence), params, sequence.key())
            # Read at once: on a CPU `async_eval` computes the whole graph before it
            # returns, so queuing the next forward first would hold the first token
            # back by a step (TTFT). That forward is built below but left lazy.
            first = token_id(sequence.pending)
            if sequence.depth > 0:
                # Speculative requests take their first token plainly, then draft.
                sequence.pending = None
                return [first]
        assert sequence.state is not None
        current = sequence.pending
        if sequence.budget > 1:
            logits = self.adapter.step(sequence.state, current.reshape(1))
            sequence.pending = sample(logits, params, sequence.key(1))
            if first is None:
                mx.async_eval(sequence.pending)  # type: ignore[no-untyped-call]
        else:
            sequence.pending = None
        return [token_id(current) if first is None else first]

    def _choose(self, sequence: RequestState, chooser: TokenChooser) -> list[int]:
        """A chooser's own decode step, pipelined as `_decode`: the forward fed by its
        drawn token (``pending``) is queued before that token is read and taken, and
        the next one is drawn under the mask made meanwhile. Its first token is read
        at once (TTFT); a speculative request's first token leaves nothing pending."""
        assert sequence.state is not None
        first = not sequence.transcript
        if sequence.pending is None:
            if first:
                logits = self._first_logits(sequence)
            else:
                logits = self.adapter.step(sequence.state, mx.array(sequence.transcript[-1:]))
            sequence.pending = chooser.draw_next(logits, sequence.key(), sequence.budget)
            if not first:
                mx.async_eval(sequence.pending)  # type: ignore[no-untyped-call]
        current, sequence.pending = sequence.pending, None
        ahead: mx.array | None = None
        if not first and sequence.budget > 1:
            ahead = self.adapter.step(sequence.state, current.reshape(1).astype(mx.int32))
            mx.async_eval(ahead)  # type: ignore[no-untyped-call]
        token = self._take(sequence, chooser, token_id(current))
        if token is None:
            return []
        if self._ends(sequence, chooser, token, 1) or (first and sequence.depth > 0):
            return [token]
        if ahead is None:  # the first token: its next forward is built, left lazy
            ahead = self.adapter.step(sequence.state, current.reshape(1).astype(mx.int32))
        sequence.pending = chooser.draw_next(ahead, sequence.key(1), sequence.budget - 1)
        if not first:
            mx.async_eval(sequence.pending)  # type: ignore[no-untyped-call]
        return [token]

    def _take(self, sequence: RequestState, chooser: TokenChooser, token: int) -> int | None:
        """``token``, drawn by ``chooser`` and read back, taken by it (None: its choice
        failed, and the request with it)."""
        try:
            chooser.take(token)
        except Exception as exc:
            self._fail(sequence, exc)
            return None
        return token

    @staticmethod
    def _ends(sequence: RequestState, chooser: TokenChooser, token: int, emitting: int) -> bool:
        """``token``, the last of the ``emitting`` tokens this step emits, ends the request
        (the engine finishes it on emitting them): nothing may be drawn after it."""
        if token in sequence.request.params.stop_token_ids or chooser.finished:
            return True
        return sequence.budget - emitting <= 0

    def _fail(self, sequence: RequestState, exc: Exception) -> None:
        """The request's own token choice failed: it alone fails (``failed``)."""
        log.error("request %s failed", sequence.request_id, exc_info=exc)
        self.failed[sequence.request_id] = f"{type(exc).__name__}: {exc}"

    def _decode_all(self, sequences: list[RequestState]) -> dict[str, list[int]]:
        """Requests in steady decoding join a batch and every batch takes one step."""
        emitted: dict[str, list[int]] = {}
        named = self._leave_unnamed(sequences)
        for sequence in sequences:
            if sequence.request_id in self._batch_of:
                continue
            if self._starts_in_batch(sequence, sequences):
                continue
            alone = self._alone(sequence, sequences)
            if not alone and self._ready(sequence) and self._enter(sequence):
                continue
            if sequence.depth > 0 and sequence.generated:
                emitted[sequence.request_id] = self._speculate(sequence, sequence.depth)
            else:
                emitted[sequence.request_id] = self._decode(sequence)
        stepping = [b for b in self.batches if any(s.request_id in named for s in b.rows)]
        for batch in stepping:
            self._step(batch, emitted)
        return emitted

    def _starts_in_batch(self, sequence: RequestState, sequences: list[RequestState]) -> bool:
        """A plain request whose prompt is in but for its last token, in a step with
        others: it joins their batch with that token as its input, and the batch's step
        draws its first token (emitted with the next step), rather than a forward of its
        own (`Scheduler._joining`). Its prompt state goes to the prefix cache first, as
        `_first_logits` keeps it. False: it takes its first token its own way."""
        if (
            len(sequences) < 2
            or sequence.phase is not Phase.PREFILL
            or sequence.prompt_remaining > 0
            or sequence.chooser is not None
            or sequence.depth > 0
            or sequence.budget < 2
            or sequence.state is None
        ):
            return False
        if self.prefix_cache is not None and sequence.prefilled > sequence.cached_tokens:
            self.prefix_cache.store(sequence.prompt[: sequence.prefilled], sequence.state)
        sequence.phase = Phase.DECODE
        return self._enter(sequence)

    def _alone(self, sequence: RequestState, sequences: list[RequestState]) -> bool:
        """A plain request decoding by itself, no batch in use: it steps on its own
        caches rather than in a batch of one. A batch's step costs a single sequence
        more (each layer's mask over the ring and per-row positions: about 10 % of a
        small model's step on a CPU), and one client is the common case. It joins a
        batch when another request decodes beside it."""
        return (
            len(sequences) == 1
            and not self.batches
            and sequence.chooser is None
            and sequence.depth == 0
        )

    @staticmethod
    def _ready(sequence: RequestState) -> bool:
        """Past its first token, with its next input known: it may decode in a batch."""
        if sequence.state is None or sequence.phase is not Phase.DECODE:
            return False
        if sequence.chooser is not None:
            # Its next input is its drawn token, or else its last emitted one.
            return sequence.pending is not None or bool(sequence.generated)
        if sequence.depth == 0:
            return sequence.pending is not None and sequence.budget > 1
        return sequence.pending is not None or bool(sequence.generated)

    def _enter(self, sequence: RequestState) -> bool:
        """Put the sequence in a batch that fits it, or a new one; False if none can."""
        state = sequence.state
        assert state is not None
        # Rows a batch may soon hold (it may allocate them at once): its own and the
        # requests running outside any batch, this one included.
        unbatched = len(self._live) - len(self._batch_of)
        try:
            for batch in self.batches:
                if can_join(batch.state, state) and batch.state.fits(state):
                    self._materialize(batch)
                    expected = len(batch.rows) + unbatched
                    batch.state.join([state], [sequence.budget], expected)
                    break
            else:
                created = new_batch(self.adapter, [state], [sequence.budget], unbatched)
                if created is None:
                    return False
                batch = _Batch(created, [])
                self.batches.append(batch)
        except Exception:
            # The sequence decodes on its own; a failure stays with the request causing it.
            log.exception("request %s cannot join a decode batch", sequence.request_id)
            return False
        batch.rows.append(sequence)
        self._batch_of[sequence.request_id] = batch
        # The batch holds the row now; the single-sequence state is not kept twice.
        sequence.state = None
        return True

    def _step(self, batch: _Batch, emitted: dict[str, list[int]]) -> None:
        rows = batch.rows
        emits: list[bool] | None = None
        if batch.tokens is None:
            # Rows that joined with their next token sampled emit it now; speculative
            # rows joined with their last emitted token, not yet in their caches, and
            # starting ones with their last prompt token (`_starts_in_batch`).
            emits = [s.pending is not None for s in rows]
            inputs = mx.concatenate(
                [
                    s.pending.reshape(1).astype(mx.int32)
                    if s.pending is not None
                    else mx.array((s.generated or s.prompt)[-1:], dtype=mx.int32)
                    for s in rows
                ]
            )
            for sequence in rows:
                sequence.pending = None
        else:
            inputs = batch.tokens
        logits = batch.state.step(inputs)
        # A row emitting its input now draws the token after it.
        ahead = [int(emits is None or emits[i]) for i in range(len(rows))]
        if any(s.chooser is not None for s in rows):
            mx.async_eval(logits)  # type: ignore[no-untyped-call]
            values = inputs.tolist()
            assert isinstance(values, list)
            drawn = self._draw_rows(rows, logits, values, ahead)  # type: ignore[arg-type]
            following = self._sample(rows, logits, ahead, drawn).astype(mx.int32)
            mx.async_eval(following)  # type: ignore[no-untyped-call]
        else:
            following = self._sample(rows, logits, ahead).astype(mx.int32)
            mx.async_eval(following)  # type: ignore[no-untyped-call]
            values = inputs.tolist()
            assert isinstance(values, list)
        for index, sequence in enumerate(rows):
            if emits is None or emits[index]:
                emitted[sequence.request_id] = [int(values[index])]  # type: ignore[arg-type]
            if sequence.depth > 0:  # a speculative request's plain step, for depths_chosen
                sequence.stats.count_step(0)
        batch.tokens = following

    def _draw_rows(
        self, rows: list[RequestState], logits: mx.array, values: list[int], ahead: Sequence[int]
    ) -> dict[int, mx.array]:
        """The rows with a `TokenChooser`, in row order, while the step's forward runs:
        each takes the input it emits now (``values``, read back), then draws its next
        token from the batch's logits [B, V] lazily, with its own key and budget, under
        the mask made now. A row whose token ends it draws nothing; one whose choice
        fails fails alone. Either gets a stand-in 0, fed to no step that emits (it
        leaves the batch first)."""
        drawn: dict[int, mx.array] = {}
        stand_in = mx.array(0, dtype=mx.uint32)
        for index, sequence in enumerate(rows):
            chooser = sequence.chooser
            if chooser is None:
                continue
            drawn[index] = stand_in
            if ahead[index]:
                token = self._take(sequence, chooser, int(values[index]))
                if token is None or self._ends(sequence, chooser, token, 1):
                    continue
            remaining = sequence.budget - ahead[index]
            drawn[index] = chooser.draw_next(logits[index], sequence.key(ahead[index]), remaining)
        return drawn

    def _choose_rows(
        self,
        rows: list[RequestState],
        logits: mx.array,
        ahead: Sequence[int],
        done: set[str],
    ) -> dict[int, mx.array]:
        """The rows with a `TokenChooser` (but those in ``done``) choose from the batch's
        logits [B, V] now, in row order, each with the key and budget of its position
        ``ahead``, as alone (a round with no room to draft: its tokens are read at once).
        A row whose choice fails fails alone (a stand-in 0 it never emits)."""
        choosing = [
            (i, s, s.chooser)
            for i, s in enumerate(rows)
            if s.chooser is not None and s.request_id not in done
        ]
        if not choosing:
            return {}
        mx.eval(logits)  # the forward's failure is the step's, not a row's
        chosen: dict[int, mx.array] = {}
        for index, sequence, chooser in choosing:
            value = 0
            try:
                remaining = sequence.budget - ahead[index]
                value = chooser.choose(logits[index], sequence.key(ahead[index]), remaining)
            except Exception as exc:
                self._fail(sequence, exc)
            chosen[index] = mx.array(value, dtype=mx.uint32)
        return chosen

    @staticmethod
    def _sample(
        rows: list[RequestState],
        logits: mx.array,
        ahead: Sequence[int],
        chosen: dict[int, mx.array] | None = None,
    ) -> mx.array:
        """Each row's next token, lazily: sampled (with the key of its position
        ``ahead`` of those it produced), or the one its chooser drew ([], uint32)."""
        chosen = chosen or {}
        if all(s.request.params.sampling.greedy for i, s in enumerate(rows) if i not in chosen):
            tokens = mx.argmax(logits, axis=-1)
        else:
            # One graph for the batch (`sample_rows`); a chosen row's draw here is unused.
            params = [
                _UNUSED if i in chosen else s.request.params.sampling for i, s in enumerate(rows)
            ]
            tokens = sample_rows(logits, params, [s.key(ahead[i]) for i, s in enumerate(rows)])
        if not chosen:
            return tokens
        return mx.stack([chosen.get(i, tokens[i]) for i in range(len(rows))])

    def _materialize(self, batch: _Batch) -> None:
        """Give each row its own next token back, before the membership changes."""
        if batch.tokens is not None:
            for index, sequence in enumerate(batch.rows):
                sequence.pending = batch.tokens[index]
            batch.tokens = None

    def _leave_unnamed(self, sequences: list[RequestState]) -> set[str]:
        """The ids of `sequences`, the rows this step runs. Rows it does not run must
        not advance: they leave their batches and go on alone (a batch none of whose
        rows is named is left as it is)."""
        named = {s.request_id for s in sequences}
        for batch in list(self.batches):
            stray = [i for i, s in enumerate(batch.rows) if s.request_id not in named]
            if stray and len(stray) < len(batch.rows):
                self._remove(batch, stray, finished=False)
        return named

    def _remove(self, batch: _Batch, indices: list[int], finished: bool) -> None:
        """Rows leave: finished ones to the prefix cache, others with their own state."""
        self._materialize(batch)
        for index in indices:
            sequence = batch.rows[index]
            del self._batch_of[sequence.request_id]
            if not finished:
                sequence.state = batch.state.row_state(index)
            elif self.prefix_cache is not None and sequence.finish_reason in _REUSABLE:
                self._keep_final(sequence, batch.state.row_state(index))
        keep = [i for i in range(len(batch.rows)) if i not in set(indices)]
        if keep:
            batch.state.keep(keep)
            batch.rows = [batch.rows[i] for i in keep]
        else:
            self.batches.remove(batch)

    def _keep_final(self, sequence: RequestState, state: ModelState) -> None:
        """A finished request's final state, for the prefix cache: kept by
        `keep_finished`, after the finish has gone out (storing compacts the caches,
        1-3 ms on the demo on this CPU: none of the request's time)."""
        self._finished.append((sequence, state))

    def keep_finished(self) -> None:
        """Store the final states of the requests that finished since the last call.
        The engine calls it before it takes in new work, on every rank alike
        (`Engine.keep_finished`), so a request admitted next can hit them."""
        finished, self._finished = self._finished, []
        for sequence, state in finished:
            assert self.prefix_cache is not None
            tokens = (*sequence.prompt, *sequence.transcript)[: state.offset]
            if len(tokens) == state.offset and len(tokens) > sequence.prefilled:
                self.prefix_cache.store(tokens, state, owned=True)

    def drop_finished(self) -> None:
        """Forget the finished states not yet stored (a warm-up's)."""
        self._finished.clear()

    # -- speculate -------------------------------------------------------------

    def _speculate_all(self, sequences: list[RequestState], depth: int) -> dict[str, list[int]]:
        """One speculative round for several requests: drafts and verify batched.

        Every request enters (or stays in) a batch; a batch whose rows can draft
        together (``speculate``) runs one round for all of them, anything else falls
        back to a request's own round.
        """
        emitted: dict[str, list[int]] = {}
        named = self._leave_unnamed(sequences)
        for sequence in sequences:
            if sequence.request_id not in self._batch_of and not (
                self._ready(sequence) and self._enter(sequence)
            ):
                emitted[sequence.request_id] = self._speculate(sequence, depth)
        for batch in [b for b in self.batches if any(s.request_id in named for s in b.rows)]:
            drafter = batch.state.speculate if isinstance(batch.state, MTPRowBatch) else None
            rows = batch.rows
            self._materialize(batch)
            head, done = self._heads(rows)
            room = min(s.budget - 1 - len(head[s.request_id]) for s in rows)
            round_depth = min(depth, room)
            if drafter is None or round_depth <= 0:
                self._plain_round(batch, head, done, emitted)
                continue
            last = [(head[s.request_id] or s.generated)[-1] for s in rows]
            params = [s.request.params.sampling for s in rows]
            keys = [s.draws(len(head[s.request_id])) for s in rows]
            if any(s.chooser is not None for s in rows):
                # A row that is done drafts plainly: what it drafts is never emitted.
                choosers = [None if s.request_id in done else s.chooser for s in rows]
                budgets = [s.budget - len(head[s.request_id]) for s in rows]
                tokens = drafter(last, round_depth, params, keys, choosers, budgets)
            else:
                tokens = drafter(last, round_depth, params, keys)
            for sequence, row_tokens in zip(rows, tokens, strict=True):
                if sequence.request_id in done:
                    emitted[sequence.request_id] = head[sequence.request_id]
                    continue
                if isinstance(row_tokens, Exception):
                    self._fail(sequence, row_tokens)
                    continue
                sequence.stats.record(round_depth, len(row_tokens) - 1)
                emitted[sequence.request_id] = [*head[sequence.request_id], *row_tokens]
        return emitted

    def _heads(self, rows: list[RequestState]) -> tuple[dict[str, list[int]], set[str]]:
        """What each row arriving from plain batched decoding emits first: its pending
        token, read now (a chooser's taken by it). With the ids of the rows that go no
        further this step: a chooser's whose token ends it, or whose choice failed."""
        head: dict[str, list[int]] = {}
        done: set[str] = set()
        for sequence in rows:
            pending, sequence.pending = sequence.pending, None
            if pending is None:
                head[sequence.request_id] = []
                continue
            value = token_id(pending)
            token: int | None = value
            chooser = sequence.chooser
            if chooser is not None:
                token = self._take(sequence, chooser, value)
                if token is None or self._ends(sequence, chooser, token, 1):
                    done.add(sequence.request_id)
            head[sequence.request_id] = [] if token is None else [token]
        return head, done

    def _plain_round(
        self,
        batch: _Batch,
        head: dict[str, list[int]],
        done: set[str],
        emitted: dict[str, list[int]],
    ) -> None:
        """No room to draft: one plain step, emitting its tokens at once (speculative
        rows keep their next input as the last emitted token; a row in ``done`` emits
        its head only)."""
        rows = batch.rows
        last = [(head[s.request_id] or s.generated)[-1] for s in rows]
        logits = batch.state.step(mx.array(last, dtype=mx.int32))
        ahead = [len(head[s.request_id]) for s in rows]
        chosen = self._choose_rows(rows, logits, ahead, done)
        following = self._sample(rows, logits, ahead, chosen)
        values = following.tolist()
        assert isinstance(values, list)
        for sequence, value in zip(rows, values, strict=True):
            tokens = head[sequence.request_id]
            if sequence.request_id not in done:
                tokens = [*tokens, int(value)]  # type: ignore[arg-type]
            emitted[sequence.request_id] = tokens

    def _speculate(self, sequence: RequestState, depth: int) -> list[int]:
        """A round at `depth` drafts; with an automatic depth, 0 is a pipelined plain step.

        Plain steps leave the next token pending (sampled, not yet read); a round
        that follows them reads it first and drafts after it. A request that was in a
        decode batch leaves it here (alone again), with its next token pending.
        """
        batch = self._batch_of.get(sequence.request_id)
        from_batch = batch is not None
        if batch is not None:
            self._remove(batch, [batch.rows.index(sequence)], finished=False)
        assert sequence.state is not None and (sequence.generated or sequence.pending is not None)
        if sequence.chooser is not None:
            return self._speculate_chosen(sequence, sequence.chooser, depth)
        drafter = self.adapter.speculate if isinstance(self.adapter, SupportsSpeculation) else None
        if depth <= 0 or drafter is None:
            started = self.clock()
            if sequence.pending is None:
                logits = self.adapter.step(sequence.state, mx.array(sequence.generated[-1:]))
                sequence.pending = sample(logits, sequence.request.params.sampling, sequence.key())
                mx.async_eval(sequence.pending)  # type: ignore[no-untyped-call]
                clean = False
            else:
                clean = not from_batch
            tokens = self._decode(sequence)
            sequence.stats.count_step(0)
            sequence.plain_streak += 1
            if clean and sequence.pending is not None:
                self._observe(0, self.clock() - started)
            return tokens
        first: list[int] = []
        if sequence.pending is not None:
            first = [token_id(sequence.pending)]
            sequence.pending = None
        last = first[-1] if first else sequence.generated[-1]
        depth = min(depth, sequence.budget - len(first) - 1)
        if depth <= 0:
            if sequence.budget - len(first) <= 0:
                return first
            logits = self.adapter.step(sequence.state, mx.array([last]))
            token = sample(logits, sequence.request.params.sampling, sequence.key(len(first)))
            return [*first, token_id(token)]
        started = self.clock()
        tokens, drafted, accepted = drafter(
            sequence.state,
            last,
            depth,
            sequence.request.params.sampling,
            sequence.draws(len(first)),
        )
        if not first:
            # After plain steps the first draft also folds their MTP entries in: a
            # dearer round than the steady ones, so it is not timed.
            self._observe(depth, self.clock() - started)
        sequence.stats.record(drafted, accepted)
        sequence.plain_streak = 0
        if self.depth_picker is not None:
            self.depth_picker.record(drafted, accepted)
        return [*first, *tokens]

    def _speculate_chosen(
        self, sequence: RequestState, chooser: TokenChooser, depth: int
    ) -> list[int]:
        """`_speculate` for a request with a chooser: a round under its transforms
        (`MTPAdapter.speculate_chosen`), or one unpipelined step. Its rounds are not timed
        for the automatic depth: the grammar's masks make them dearer than others."""
        assert sequence.state is not None
        drafter = (
            self.adapter.speculate_chosen if isinstance(self.adapter, SupportsSpeculation) else None
        )
        depth = min(depth, sequence.budget - 1)
        if depth <= 0 or drafter is None:
            sequence.stats.count_step(0)
            sequence.plain_streak += 1
            return self._choose(sequence, chooser)
        first: list[int] = []
        if sequence.pending is not None:
            # After pipelined plain steps: their drawn token is emitted first.
            token = self._take(sequence, chooser, token_id(sequence.pending))
            sequence.pending = None
            if token is None:
                return []
            first = [token]
            depth = min(depth, sequence.budget - 2)
            if self._ends(sequence, chooser, token, 1) or depth <= 0:
                return first
        try:
            tokens, drafted, accepted = drafter(
                sequence.state,
                (first or sequence.generated)[-1],
                depth,
                chooser,
                sequence.draws(len(first)),
                sequence.budget - len(first),
            )
        except Exception as exc:
            self._fail(sequence, exc)
            return []
        sequence.stats.record(drafted, accepted)
        sequence.plain_streak = 0
        if self.depth_picker is not None:
            self.depth_picker.record(drafted, accepted)
        return [*first, *tokens]

    def _observe(self, depth: int, seconds: float) -> None:
        if self.depth_picker is not None:
            self.depth_picker.observe(depth, seconds)
