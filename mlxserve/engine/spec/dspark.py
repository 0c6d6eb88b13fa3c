"""DeepSeek-V4-Flash-0731 with its DSpark draft head: prefill, plain steps, block rounds.

State invariant, after the main model has processed tokens x_0 .. x_{n-1}: the main
cache holds n positions; the head's context (per stage, the rotated K=V rows of the
last ``sliding_window`` positions, `DSparkHead.stage_keys`) holds positions 0 .. m-1
(m <= n); ``pending`` holds the taps of positions m .. n-1, whose rows the next round
makes (plain steps only record their taps: a step pays no head work).

A round with x_n known (the anchor) and a ceiling of k drafts:
1. plan: how many drafts m to verify, decided before anything runs where it can be
   (`DSparkAdapter._plan`): from the request's running confidences per position (the
   confidence head's, `DSparkState.profile`) and the calibration's cost of a whole
   round at each m, when that beats reading this round's confidences first;
2. draft: the pending taps join the context; ONE head forward over the block
   [x_n, noise...] gives base logits for x_{n+1} .. x_{n+k}; draft j is drawn from
   its base logits plus the Markov bias of draft j - 1 (the anchor for the first), the
   way MTP drafts are drawn (`propose`, with position j's key), all on the device;
3. adaptive verification, where the plan left it to this round: the confidence head's
   chance c_j that draft j is kept gives E(m) = 1 + c_1 + c_1 c_2 + ...; of the k
   drafts, the m with the most expected tokens per second of such a round (from the
   calibration) are verified; before a calibration, those whose running product of
   confidences stays above `MIN_CONFIDENCE`. Reading c is then a host sync of its own;
4. verify: one main forward of [x_n, d_1 .. d_m] gives the targets and the taps of
   those positions; acceptance is MTP's (greedy match, coupled draws for a seed,
   rejection sampling otherwise: `mlxserve.engine.sample.acceptance`). Drafts,
   confidences, decision and caches are read back together: a planned round's one
   host sync;
5. roll back: the main cache drops the m - a rejected positions (slices); the taps of
   x_n .. x_{n+a} become the pending ones. The head keeps nothing of the block.

Why a plan: on a GPU a small-batch step is bound by the host building and launching
it, and a sync in the middle of a round leaves the device idle while the host builds
the verify (the whole draft's kernels are waited for first); verifying all k drafts
costs about what verifying fewer does there. On a CPU rows cost, a sync does not, and
this round's own confidences are worth reading. The calibration measures both kinds
of round, so each machine gets what pays on it.

Seeded output is the same at every depth and with any m (coupled draws); greedy
output is plain decoding's.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.sample.acceptance import greedy_accept, rejection_decision
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import Draws, KeyStream, probabilities, sample, token_id
from mlxserve.engine.spec.depth import expected_tokens
from mlxserve.engine.spec.draft_choice import ChosenRound
from mlxserve.engine.spec.mtp import trim_exactly
from mlxserve.hardware.tuning import EngineTuning, default_tuning, tune_model
from mlxserve.kernels.buffers import own_buffers
from mlxserve.models.deepseek_v4.dspark import DSparkHead, head_of

if TYPE_CHECKING:
    from mlxserve.engine.spec.costs import RoundCosts
    from mlxserve.engine.spec.depth import DepthPicker

#: Draws draft ``level`` from its logits [vocab] (`DSparkAdapter.propose`'s form).
Proposer = Callable[[int, mx.array, SamplingParams, mx.array], mx.array]

#: Without measured costs, drafts are verified while the running product of their
#: confidences stays at least this (a draft kept less often than not is not verified).
MIN_CONFIDENCE = 0.5

#: Plain steps let the pending taps grow; past this many rows they join the context.
MAX_PENDING = 64

#: Weight of a round's confidences in the running ones a plan reads (`DSparkState.profile`):
#: a few rounds' worth, so a reply that turns easier or harder is followed within a
#: sentence while one odd round moves the plan little.
PROFILE_WEIGHT = 0.25

#: Decides how many drafts to verify from a round's confidences (a read of them).
Decision = Callable[[mx.array, int], int]


class DSparkState:
    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.keys: list[mx.array] = []  # per stage [1, <= window, head_dim]
        self.folded = 0  # positions in the context
        self.pending: list[mx.array] = []  # taps [1, c, targets * D] of the next positions
        #: the confidence head's running chance per draft position (None: no round yet)
        self.profile: list[float] | None = None

    @property
    def offset(self) -> int:
        return int(self.cache[0].offset)


class DSparkAdapter:
    """For DeepSeek-V4 models with a DSpark head (``model.dspark``)."""

    def __init__(self, model: Any) -> None:
        head = head_of(model)
        if head is None:
            raise ValueError("the model has no DSpark head")
        self.model = model
        self.head: DSparkHead = head
        self.taps = head.spec.target_layers
        self.max_draft_depth = head.spec.block_size
        self.tuning = default_tuning()
        #: the calibration's costs, which adaptive verification weighs (`measure_costs`)
        self.costs: RoundCosts | None = None
        #: the automatic depth, which learns the confidences per position (`follow`)
        self.picker: DepthPicker | None = None
        #: verify every drafted position up to the ceiling, planned (the calibration's
        #: whole rounds; tests)
        self.verify_all = False
        #: the last running confidences of any request: where a new request's plan starts
        self.profile: list[float] | None = None

    def tune(self, tuning: EngineTuning) -> None:
        self.tuning = tuning
        tune_model(self.model, tuning)

    def follow(self, picker: DepthPicker) -> None:
        """Report each round's confidences to the automatic depth (`DepthPicker`). An
        engine that started from stored costs (no calibration here) hands its planned
        rounds over with it: plans are then made on those alone."""
        self.picker = picker
        if self.costs is None:
            self.costs = picker.calibrated

    def new_state(self, max_rollback: int) -> DSparkState:
        return DSparkState(self.model.make_cache(max_rollback=max_rollback))

    # -- the main model, tapped ------------------------------------------------

    def _forward(
        self, state: DSparkState, tokens: mx.array, queue_every: int = 0
    ) -> tuple[mx.array, mx.array]:
        """Streams [1, S, hc, D] of ``tokens`` [S] and their taps [1, S, targets * D]."""
        tapped: list[mx.array] = []
        streams = self.model.forward_hidden(
            tokens[None], state.cache, queue_every=queue_every, taps=self.taps, tapped=tapped
        )
        return streams, mx.concatenate(tapped, axis=-1)

    def _fold(self, state: DSparkState) -> None:
        """The pending taps join the context (lazily)."""
        if not state.pending:
            return
        pending = state.pending
        taps = pending[0] if len(pending) == 1 else mx.concatenate(pending, axis=1)
        new = self.head.stage_keys(self.head.context(taps), state.folded)
        window = self.head.sliding_window
        if state.keys:
            new = [
                mx.concatenate([old, rows], axis=1)
                for old, rows in zip(state.keys, new, strict=True)
            ]
        state.keys = [rows[:, -window:] for rows in new]
        state.folded += int(taps.shape[1])
        state.pending = []

    def prefill(self, state: Any, tokens: list[int]) -> None:
        assert isinstance(state, DSparkState)
        queue_every = self.tuning.prefill_queue_every_layers
        streams, taps = self._forward(state, mx.array(tokens), queue_every)
        del streams
        state.pending.append(taps)
        self._fold(state)
        mx.eval(state.keys, [c.state for c in state.cache])

    def step(self, state: Any, tokens: mx.array) -> mx.array:
        """A plain step: the main model; its taps wait for the next round."""
        assert isinstance(state, DSparkState)
        streams, taps = self._forward(state, tokens)
        state.pending.append(taps)
        if sum(int(t.shape[1]) for t in state.pending) > MAX_PENDING:
            self._fold(state)
            mx.async_eval(state.keys)  # type: ignore[no-untyped-call]
        logits: mx.array = self.model.head_from_streams(streams[:, -1:])
        return logits.reshape(-1)  # [1, 1, vocab]: a view (an integer index gathers)

    # -- a round ---------------------------------------------------------------

    def propose(
        self, level: int, logits: mx.array, params: SamplingParams, key: mx.array
    ) -> mx.array:
        """Draft ``level`` (0-based) from its logits, lazily. Benchmarks override it with
        oracle drafts of a set acceptance (`benchmarks/dspark_cost.py`)."""
        return sample(logits, params, key)

    def confidences(self, hidden: mx.array, previous: mx.array) -> mx.array:
        """The confidence head's chance that each draft is kept [k] (benchmarks override
        it with the oracle's acceptance)."""
        return self.head.confidence(hidden, previous)

    def _draft(
        self,
        state: DSparkState,
        last_token: int,
        depth: int,
        params: SamplingParams,
        draws: Draws,
        propose: Proposer,
    ) -> tuple[list[mx.array], list[mx.array], mx.array]:
        """Lazy drafts, their logits, and their confidences [depth]: one head forward,
        then the Markov chain on the device (nothing read back). Rows are taken by
        slices and reshapes (views), not integer indices (a gather kernel each)."""
        self._fold(state)
        if state.folded != state.offset:
            raise RuntimeError(f"context at {state.folded}, main model at {state.offset}")
        anchor = mx.array([last_token], dtype=mx.int32)
        hidden = self.head.hidden(self.model, anchor, state.keys, state.offset)
        hidden = hidden[:, :depth].reshape(depth, -1)
        base = self.model.output_head(hidden)
        vocab = int(base.shape[-1])
        previous = anchor.reshape(())
        drafts: list[mx.array] = []
        draft_logits: list[mx.array] = []
        for level in range(depth):
            logits = self.head.step_logits(base[level : level + 1].reshape(vocab), previous)
            previous = propose(level, logits, params, draws.key(level)).reshape(()).astype(mx.int32)
            drafts.append(previous)
            draft_logits.append(logits)
        before = mx.stack([anchor.reshape(()), *drafts[:-1]])
        return drafts, draft_logits, self.confidences(hidden, before)

    def _plan(self, state: DSparkState, depth: int) -> int | None:
        """How many of ``depth`` drafts to verify, decided before the round runs, so the
        round reads the host once (drafts, confidences and verdict together); None: read
        this round's confidences first (`_verified`).

        Planned: the m in 1 .. depth with the most expected tokens per second of a whole
        round (the calibration's ``rounds[m]``), E(m) from the request's running
        confidences (`DSparkState.profile`; a new request starts from the last one
        seen), if that rate is at least the best of a round that reads its confidences
        first (``verify[m]``: such a round, whole) at those same confidences. Not
        planned: without a calibration, or before any round has given confidences."""
        if self.verify_all:
            return depth
        costs = self.costs
        profile = state.profile or self.profile
        if costs is None or not costs.rounds or profile is None:
            return None
        planned = {
            m: expected_tokens(profile, m) / costs.rounds[m]
            for m in range(1, depth + 1)
            if m in costs.rounds
        }
        if not planned:
            return None
        best = max(planned, key=lambda m: planned[m])
        read = [m for m in range(depth + 1) if m in costs.verify]
        read_first = max((expected_tokens(profile, m) / costs.verify[m] for m in read), default=0.0)
        return best if planned[best] >= read_first else None

    def _observe(self, values: list[float], state: DSparkState | None) -> None:
        """A round's confidences: to the automatic depth, and into the running ones
        its request's next plans read."""
        if self.picker is not None:
            self.picker.observe_confidence(values)
        old = (state.profile if state is not None else None) or self.profile or []
        profile = [
            value if i >= len(old) else old[i] + PROFILE_WEIGHT * (value - old[i])
            for i, value in enumerate(values)
        ]
        profile += old[len(values) :]
        self.profile = profile
        if state is not None:
            state.profile = profile

    def _verified(self, confidence: mx.array, depth: int, state: DSparkState | None = None) -> int:
        """How many drafts to verify (`MIN_CONFIDENCE`, or the most expected tokens per
        second of a round that read its confidences, ``costs.verify``); a host read of
        the confidences."""
        if self.verify_all:
            return depth
        values = _floats(confidence)
        self._observe(values, state)
        costs = self.costs
        if costs is None or not costs.verify:
            kept, count = 1.0, 0
            for value in values:
                kept *= value
                if kept < MIN_CONFIDENCE:
                    break
                count += 1
            return count
        rates = {
            m: expected_tokens(values, m) / (costs.verify.get(m, costs.plain) + 1e-9)
            for m in range(depth + 1)
        }
        return max(rates, key=lambda m: rates[m])

    def _count(
        self,
        state: DSparkState,
        plan: int | None,
        drafts: list[mx.array],
        confidence: mx.array,
        depth: int,
        decide: Decision | None,
    ) -> int:
        """The drafts to verify: the plan's, or (no plan) decided on this round's
        confidences, read now (``decide``, else `_verified`): the round's first sync."""
        if plan is not None:
            return plan
        mx.eval(drafts, confidence)
        if decide is not None:
            return decide(confidence, depth)
        return self._verified(confidence, depth, state)

    def _verify(
        self, state: DSparkState, last_token: int, drafts: list[mx.array]
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Draft ids [m], the main logits [m + 1, vocab] and the taps of the verify.
        Drafts still lazy (a planned round) are queued first, so the device runs the
        head while the host builds the verify (as `mtp.verify_streams` does)."""
        queue_every = self.tuning.verify_queue_every_layers
        if queue_every and drafts:
            mx.async_eval(drafts)  # type: ignore[no-untyped-call]
        ids = mx.stack(drafts) if drafts else mx.zeros((0,), dtype=mx.int32)
        tokens = mx.concatenate([mx.array([last_token], dtype=mx.int32), ids.astype(mx.int32)])
        streams, taps = self._forward(state, tokens, queue_every)
        logits: mx.array = self.model.head_from_streams(streams)
        return ids, logits.reshape(logits.shape[1:]), taps

    def speculate(
        self, state: Any, last_token: int, depth: int, params: SamplingParams, draws: Draws
    ) -> tuple[list[int], int, int]:
        """One draft + verify round; returns (tokens to emit, verified, accepted)."""
        assert isinstance(state, DSparkState) and depth >= 1
        depth = min(depth, self.max_draft_depth)
        return self._round(state, last_token, depth, params, draws, self._plan(state, depth))

    def _round(
        self,
        state: DSparkState,
        last_token: int,
        depth: int,
        params: SamplingParams,
        draws: Draws,
        plan: int | None,
        decide: Decision | None = None,
    ) -> tuple[list[int], int, int]:
        """`speculate` with its plan given (None: decided on the round's confidences,
        by ``decide`` if given): the calibration times both kinds of round."""
        drafts, draft_logits, confidence = self._draft(
            state, last_token, depth, params, draws, self.propose
        )
        count = self._count(state, plan, drafts, confidence, depth, decide)
        drafts, draft_logits = drafts[:count], draft_logits[:count]
        ids, logits, taps = self._verify(state, last_token, drafts)
        caches = [c.state for c in state.cache]
        if params.greedy or draws.coupled:
            if params.greedy:
                targets = mx.argmax(logits, axis=-1)
            else:
                targets = draws.pick(mx.log(probabilities(logits, params)))
            mx.eval(ids, targets, taps, caches, confidence)
            emitted = greedy_accept(_ints(ids), _ints(targets))
        else:
            vocab = int(logits.shape[-1])
            q = (
                probabilities(mx.stack(draft_logits), params)
                if count
                else mx.zeros((0, vocab), dtype=mx.float32)
            )
            kept, final = rejection_decision(ids, q, probabilities(logits, params), draws)
            mx.eval(ids, kept, final, taps, caches, confidence)
            emitted = [*_ints(ids)[: token_id(kept)], token_id(final)]
        if plan is not None and decide is None:
            self._observe(_floats(confidence), state)  # read back with the verdict
        return _settle(state, emitted, count, taps)

    def speculate_chosen(
        self,
        state: Any,
        last_token: int,
        depth: int,
        chooser: TokenChooser,
        draws: Draws,
        remaining: int,
    ) -> tuple[list[int], int, int]:
        """`speculate` for a request with a `TokenChooser`: drafts and targets under its
        transforms (`mlxserve.engine.spec.draft_choice`)."""
        assert isinstance(state, DSparkState) and depth >= 1
        depth = min(depth, self.max_draft_depth)
        plan = self._plan(state, depth)
        chosen = ChosenRound(chooser, remaining)
        drafts, _, confidence = self._draft(
            state, last_token, depth, chooser.params, draws, chosen.propose
        )
        count = self._count(state, plan, drafts, confidence, depth, None)
        chosen.truncate(count)
        _, logits, taps = self._verify(state, last_token, chosen.drafts)
        caches = [c.state for c in state.cache]
        mx.async_eval(logits, taps, caches, confidence)  # type: ignore[no-untyped-call]
        emitted = chosen.verify(logits, draws)
        if plan is not None:
            self._observe(_floats(confidence), state)  # computed with the verify
        return _settle(state, emitted, count, taps)

    # -- costs, copies ---------------------------------------------------------

    def measure_costs(
        self,
        tick: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> RoundCosts:
        """A plain step, one draft (the whole block), and whole rounds on a throw-away
        state: planned ones at every ceiling (all drafts verified, one host sync) and
        ones that read their confidences first, verifying each m in 0 .. block;
        interleaved, the median of five after an untimed pass. Kept for the plans and
        adaptive verification (`costs`); the automatic depth gets the planned rounds."""
        from mlxserve.engine.spec.costs import RoundCosts

        costs = measure_dspark_costs(self, tick, clock)
        self.costs = costs
        return RoundCosts(plain=costs.plain, rounds=dict(costs.rounds))

    def snapshot(self, state: Any) -> DSparkState:
        assert isinstance(state, DSparkState)
        return copy.deepcopy(state)

    def compact(self, state: Any) -> None:
        assert isinstance(state, DSparkState)
        for cache in state.cache:
            cache.compact()
        state.keys = own_buffers(state.keys)
        state.pending = own_buffers(state.pending)

    def nbytes(self, state: Any) -> int:
        assert isinstance(state, DSparkState)
        held = sum(int(getattr(c, "nbytes", 0)) for c in state.cache)
        return held + sum(int(a.nbytes) for a in (*state.keys, *state.pending))


def _settle(
    state: DSparkState, emitted: list[int], verified: int, taps: mx.array
) -> tuple[list[int], int, int]:
    """Trim the rejected positions; the kept ones' taps wait for the next round."""
    accepted = len(emitted) - 1
    for cache in state.cache:
        trim_exactly(cache, verified - accepted)
    state.pending = [taps[:, : accepted + 1]]
    return emitted, verified, accepted


def measure_dspark_costs(
    adapter: DSparkAdapter,
    tick: Callable[[], None],
    clock: Callable[[], float],
    trials: int = 5,
    steps: int = 8,
    context: int = 32,
) -> RoundCosts:
    """`DSparkAdapter.measure_costs`'s probes: ``plain`` a pipelined step, ``draft`` the
    head's whole block (synced), ``verify[m]`` a whole round that reads its
    confidences, then verifies m drafts (m = 0: the anchor alone), ``rounds[k]`` a
    planned round verifying all k drafts. The probes' confidences (of made-up tokens)
    leave the adapter's running ones as they were."""
    from mlxserve.engine.spec.costs import RoundCosts, interleaved_medians

    vocab = int(adapter.model.args.vocab_size)
    block = adapter.max_draft_depth
    state = adapter.new_state(max_rollback=max(steps, block) + 1)
    adapter.prefill(state, [(7 * i + 3) % vocab for i in range(context)])
    token = mx.array([1], mx.int32)
    greedy = SamplingParams()
    keys = KeyStream(0).at(0)
    profile = adapter.profile

    def plain() -> float:
        probe = adapter.snapshot(state)
        start = clock()
        current = token
        for _ in range(steps):
            current = mx.argmax(adapter.step(probe, current)).reshape(1)
            mx.async_eval(current)  # type: ignore[no-untyped-call]
        mx.eval(current, [c.state for c in probe.cache])
        return (clock() - start) / steps

    def draft() -> float:
        probe = adapter.snapshot(state)
        start = clock()
        drafts, _, confidence = adapter._draft(probe, 1, block, greedy, keys, adapter.propose)
        mx.eval(drafts, confidence)
        return clock() - start

    def read_first(m: int) -> float:
        probe = adapter.snapshot(state)
        start = clock()
        adapter._round(probe, 1, block, greedy, keys, None, lambda c, _: _read(c, m))
        return clock() - start

    def planned(k: int) -> float:
        probe = adapter.snapshot(state)
        start = clock()
        adapter._round(probe, 1, k, greedy, keys, k)
        return clock() - start

    probes: dict[str, Callable[[], float]] = {"plain": plain, "draft": draft}
    for m in range(block + 1):
        probes[f"read{m}"] = lambda m=m: read_first(m)  # type: ignore[misc]
    for k in range(1, block + 1):
        probes[f"round{k}"] = lambda k=k: planned(k)  # type: ignore[misc]
    try:
        median = interleaved_medians(probes, trials, tick)
    finally:
        adapter.profile = profile
    return RoundCosts(
        plain=median["plain"],
        verify={m: median[f"read{m}"] for m in range(block + 1)},
        draft=median["draft"],
        rounds={k: median[f"round{k}"] for k in range(1, block + 1)},
    )


def _read(confidence: mx.array, count: int) -> int:
    """``count``, after reading ``confidence`` to the host as a round deciding on it does."""
    _floats(confidence)
    return count


def _floats(values: mx.array) -> list[float]:
    out = values.tolist()
    assert isinstance(out, list)
    return [float(v) for v in out]  # type: ignore[arg-type]


def _ints(values: mx.array) -> list[int]:
    out = values.tolist()
    assert isinstance(out, list)
    return [int(v) for v in out]  # type: ignore[arg-type]
