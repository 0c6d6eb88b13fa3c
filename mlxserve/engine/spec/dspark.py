"""DeepSeek-V4-Flash-0731 with its DSpark draft head: prefill, plain steps, block rounds.

State invariant, after the main model has processed tokens x_0 .. x_{n-1}: the main
cache holds n positions; the head's context (per stage, the rotated K=V rows of the
last ``sliding_window`` positions, `DSparkHead.stage_keys`) holds positions 0 .. m-1
(m <= n); ``pending`` holds the taps of positions m .. n-1, whose rows the next round
makes (plain steps only record their taps: a step pays no head work).

A round with x_n known (the anchor) and a ceiling of k drafts:
1. draft: the pending taps join the context; ONE head forward over the block
   [x_n, noise...] gives base logits for x_{n+1} .. x_{n+block}; draft j is drawn from
   its base logits plus the Markov bias of draft j - 1 (the anchor for the first), the
   way MTP drafts are drawn (`propose`, with position j's key);
2. adaptive verification: the confidence head's chance c_j that draft j is kept gives
   E(m) = 1 + c_1 + c_1 c_2 + ...; of the first k drafts, the m with the most expected
   tokens per second of the round's remaining work (draft spent, verify(m) to come,
   from the calibration) are verified; before a calibration, those whose running
   product of confidences stays above `MIN_CONFIDENCE`. Reading c is the round's first
   host sync;
3. verify: one main forward of [x_n, d_1 .. d_m] gives the targets and the taps of
   those positions; acceptance is MTP's (greedy match, coupled draws for a seed,
   rejection sampling otherwise: `mlxserve.engine.sample.acceptance`): the second sync;
4. roll back: the main cache drops the m - a rejected positions (slices); the taps of
   x_n .. x_{n+a} become the pending ones. The head keeps nothing of the block.

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


class DSparkState:
    def __init__(self, cache: list[Any]) -> None:
        self.cache = cache
        self.keys: list[mx.array] = []  # per stage [1, <= window, head_dim]
        self.folded = 0  # positions in the context
        self.pending: list[mx.array] = []  # taps [1, c, targets * D] of the next positions

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
        #: verify every drafted position up to the ceiling (the calibration's rounds)
        self.verify_all = False

    def tune(self, tuning: EngineTuning) -> None:
        self.tuning = tuning
        tune_model(self.model, tuning)

    def follow(self, picker: DepthPicker) -> None:
        """Report each round's confidences to the automatic depth (`DepthPicker`)."""
        self.picker = picker

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
        taps = mx.concatenate(state.pending, axis=1)
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
        return logits[0, -1]

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
        """Lazy drafts, their logits, and their confidences [depth]."""
        self._fold(state)
        if state.folded != state.offset:
            raise RuntimeError(f"context at {state.folded}, main model at {state.offset}")
        anchor = mx.array([last_token], dtype=mx.int32)
        hidden = self.head.hidden(self.model, anchor, state.keys, state.offset)[0, :depth]
        base = self.model.output_head(hidden)
        previous = anchor[0]
        drafts: list[mx.array] = []
        draft_logits: list[mx.array] = []
        for level in range(depth):
            logits = self.head.step_logits(base[level], previous)
            previous = propose(level, logits, params, draws.key(level)).reshape(()).astype(mx.int32)
            drafts.append(previous)
            draft_logits.append(logits)
        before = mx.stack([anchor[0], *drafts[:-1]])
        return drafts, draft_logits, self.confidences(hidden, before)

    def _verified(self, confidence: mx.array, depth: int) -> int:
        """How many drafts to verify (`MIN_CONFIDENCE`, or the most expected tokens per
        second of the round's remaining work); a host read of the confidences."""
        if self.verify_all:
            return depth
        values = _floats(confidence)
        if self.picker is not None:
            self.picker.observe_confidence(values)
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

    def _verify(
        self, state: DSparkState, last_token: int, drafts: list[mx.array]
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Draft ids [m], the main logits [m + 1, vocab] and the taps of the verify."""
        ids = mx.stack(drafts) if drafts else mx.zeros((0,), dtype=mx.int32)
        tokens = mx.concatenate([mx.array([last_token], dtype=mx.int32), ids.astype(mx.int32)])
        queue_every = self.tuning.verify_queue_every_layers
        streams, taps = self._forward(state, tokens, queue_every)
        logits: mx.array = self.model.head_from_streams(streams)[0]
        return ids, logits, taps

    def speculate(
        self, state: Any, last_token: int, depth: int, params: SamplingParams, draws: Draws
    ) -> tuple[list[int], int, int]:
        """One draft + verify round; returns (tokens to emit, verified, accepted)."""
        assert isinstance(state, DSparkState) and depth >= 1
        depth = min(depth, self.max_draft_depth)
        drafts, draft_logits, confidence = self._draft(
            state, last_token, depth, params, draws, self.propose
        )
        mx.eval(drafts, confidence)
        count = self._verified(confidence, depth)
        drafts, draft_logits = drafts[:count], draft_logits[:count]
        ids, logits, taps = self._verify(state, last_token, drafts)
        caches = [c.state for c in state.cache]
        if params.greedy or draws.coupled:
            if params.greedy:
                targets = mx.argmax(logits, axis=-1)
            else:
                targets = draws.pick(mx.log(probabilities(logits, params)))
            mx.eval(targets, taps, caches)
            emitted = greedy_accept(_ints(ids), _ints(targets))
        else:
            vocab = int(logits.shape[-1])
            q = (
                probabilities(mx.stack(draft_logits), params)
                if count
                else mx.zeros((0, vocab), dtype=mx.float32)
            )
            kept, final = rejection_decision(ids, q, probabilities(logits, params), draws)
            mx.eval(kept, final, taps, caches)
            emitted = [*_ints(ids)[: token_id(kept)], token_id(final)]
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
        chosen = ChosenRound(chooser, remaining)
        drafts, _, confidence = self._draft(
            state, last_token, depth, chooser.params, draws, chosen.propose
        )
        mx.eval(drafts, confidence)
        count = self._verified(confidence, depth)
        chosen.truncate(count)
        _, logits, taps = self._verify(state, last_token, chosen.drafts)
        mx.async_eval(logits, taps, [c.state for c in state.cache])  # type: ignore[no-untyped-call]
        emitted = chosen.verify(logits, draws)
        return _settle(state, emitted, count, taps)

    # -- costs, copies ---------------------------------------------------------

    def measure_costs(
        self,
        tick: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> RoundCosts:
        """A plain step, the verify of 1 .. block + 1 tokens, one draft (the whole
        block) and a whole round at every ceiling (all its drafts verified), on a
        throw-away state; interleaved, the median of five after an untimed pass. Kept
        for adaptive verification (`costs`)."""
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
    """`DSparkAdapter.measure_costs`'s probes: ``verify[m]`` is the forward of m + 1
    tokens (m = 0: one token, synced), ``draft`` the head's whole block, ``rounds[k]``
    a round verifying all k drafts."""
    from mlxserve.engine.spec.costs import RoundCosts, interleaved_medians

    vocab = int(adapter.model.args.vocab_size)
    block = adapter.max_draft_depth
    state = adapter.new_state(max_rollback=max(steps, block) + 1)
    adapter.prefill(state, [(7 * i + 3) % vocab for i in range(context)])
    token = mx.array([1], mx.int32)
    varied = mx.array([(31 * i + 11) % vocab for i in range(block + 1)], mx.int32)
    greedy = SamplingParams()
    keys = KeyStream(0).at(0)

    def plain() -> float:
        probe = adapter.snapshot(state)
        start = clock()
        current = token
        for _ in range(steps):
            current = mx.argmax(adapter.step(probe, current)).reshape(1)
            mx.async_eval(current)  # type: ignore[no-untyped-call]
        mx.eval(current, [c.state for c in probe.cache])
        return (clock() - start) / steps

    def verify(m: int) -> float:
        probe = adapter.snapshot(state)
        start = clock()
        streams, taps = adapter._forward(probe, varied[: m + 1])
        logits = adapter.model.head_from_streams(streams)
        mx.eval(mx.argmax(logits, axis=-1), taps, [c.state for c in probe.cache])
        return clock() - start

    def draft() -> float:
        probe = adapter.snapshot(state)
        start = clock()
        drafts, _, confidence = adapter._draft(probe, 1, block, greedy, keys, adapter.propose)
        mx.eval(drafts, confidence)
        return clock() - start

    def whole_round(k: int) -> float:
        probe = adapter.snapshot(state)
        adapter.verify_all = True
        try:
            start = clock()
            adapter.speculate(probe, 1, k, greedy, keys)
            return clock() - start
        finally:
            adapter.verify_all = False

    probes: dict[str, Callable[[], float]] = {"plain": plain, "draft": draft}
    for m in range(block + 1):
        probes[f"verify{m}"] = lambda m=m: verify(m)  # type: ignore[misc]
    for k in range(1, block + 1):
        probes[f"round{k}"] = lambda k=k: whole_round(k)  # type: ignore[misc]
    median = interleaved_medians(probes, trials, tick)
    return RoundCosts(
        plain=median["plain"],
        verify={m: median["draft"] + median[f"verify{m}"] for m in range(block + 1)},
        draft=median["draft"],
        rounds={k: median[f"round{k}"] for k in range(1, block + 1)},
    )


def _floats(values: mx.array) -> list[float]:
    out = values.tolist()
    assert isinstance(out, list)
    return [float(v) for v in out]  # type: ignore[arg-type]


def _ints(values: mx.array) -> list[int]:
    out = values.tolist()
    assert isinstance(out, list)
    return [int(v) for v in out]  # type: ignore[arg-type]
