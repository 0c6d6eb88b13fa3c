"""DeepSeek-V4 with its MTP drafter: prefill, plain steps and speculative rounds.

State invariant, after the main model has processed tokens x_0 .. x_{n-1}:
the main cache holds n positions; MTP block 0's cache holds positions 0 .. m-1
(m < n), each built from the main model's streams h_p and the true next token
x_{p+1}; `carry` holds the streams h_m .. h_{n-1} whose MTP entries are still to
be made, and `carry_tokens` their known successors x_{m+1} .. x_{n-1} (the last
one, x_n, is the token the next step feeds).

A speculative round with x_n known and depth k (as vLLM's and SGLang's MTP run it):
1. draft: MTP block 0 on (carry, carry_tokens + [x_n]) in ONE forward: it makes the
   exact MTP entries of the positions accepted last round and gives d_1 from the
   last row; on its own output streams and d_{j-1} it gives d_j (guessed entries);
2. verify: one main forward of [x_n, d_1 .. d_k] gives the main model's choice
   after every prefix and the streams h_n .. h_{n+k};
3. accept a drafts (greedy match or rejection sampling) plus one token; drafts,
   decision and the caches are evaluated together: the round's one host sync;
4. roll back by trimming (slices, nothing copied): the main cache drops the k - a
   rejected positions, the MTP caches their guessed entries; carry becomes
   h_n .. h_{n+a}, waiting for the next round's first draft.
A round therefore costs one verify forward plus k draft forwards (the first one
a few rows wide) and one sync.
"""

import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.sample.acceptance import greedy_accept, rejection_decision
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import Draws, probabilities, sample, token_id
from mlxserve.engine.spec.draft_choice import ChosenRound
from mlxserve.hardware.tuning import EngineTuning, default_tuning, tune_model
from mlxserve.kernels.buffers import own_buffers

if TYPE_CHECKING:
    from mlxserve.engine.spec.costs import RoundCosts

#: Draws draft ``level`` from the MTP logits [vocab] (`MTPAdapter.propose`'s form).
Proposer = Callable[[int, mx.array, SamplingParams, mx.array], mx.array]

MAX_DRAFT_DEPTH = 5

#: Plain steps let the carry grow; past this many rows it is folded into the MTP cache.
MAX_CARRY = 64


def verify_streams(
    model: Any, tokens: mx.array, cache: Any, drafts: list[mx.array], queue_every: int
) -> mx.array:
    """The verify forward of `tokens` [B, k + 1] (the last token and the drafts): the
    device starts on the draft chain at once, then on the verify every `queue_every`
    layers (the tuning's `verify_queue_every_layers`; 0 queues nothing), so it runs
    while the host builds the rest of the round, which is waited for at once
    (docs/engine.md#tuning). Returns the main model's streams [B, k + 1, hc, D]."""
    if queue_every and drafts:
        mx.async_eval(drafts)  # type: ignore[no-untyped-call]
    streams: mx.array = model.forward_hidden(tokens, cache, queue_every=queue_every)
    return streams


class MTPState:
    def __init__(self, cache: list[Any], mtp_cache: list[Any]) -> None:
        self.cache = cache
        self.mtp_cache = mtp_cache
        self.carry: mx.array | None = None  # [1, c, hc, D]
        self.carry_tokens: list[mx.array] = []  # c - 1 tokens in all, each [j]

    @property
    def offset(self) -> int:
        return int(self.cache[0].offset)


def trim_exactly(cache: Any, n: int) -> None:
    if n and cache.trim(n) != n:
        raise RuntimeError(f"cache trimmed fewer than the {n} positions asked")


class MTPAdapter:
    """For models with `forward_hidden`, `head_from_streams`, `mtp_forward` and
    `mtp_fill` (the MTP cache entries alone, for positions already decoded)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.max_draft_depth = MAX_DRAFT_DEPTH if model.num_mtp_blocks > 0 else 0
        self.tuning = default_tuning()

    def tune(self, tuning: EngineTuning) -> None:
        self.tuning = tuning
        tune_model(self.model, tuning)

    def new_state(self, max_rollback: int) -> MTPState:
        return MTPState(
            self.model.make_cache(max_rollback=max_rollback),
            self.model.make_mtp_cache(max_rollback=max_rollback),
        )

    def _carry(self, state: MTPState, streams: mx.array, tokens: mx.array) -> None:
        """Main streams [1, n, hc, D] of `tokens` [n] join the carry."""
        tokens = tokens.astype(mx.int32)
        if state.carry is None:
            state.carry = streams
            state.carry_tokens = [tokens[1:]] if tokens.size > 1 else []
        else:
            state.carry = mx.concatenate([state.carry, streams], axis=1)
            state.carry_tokens.append(tokens)

    def _fold(self, state: MTPState, keep: int) -> None:
        """Make the MTP entries of all carry rows but the last `keep` (lazily)."""
        assert state.carry is not None
        rows = int(state.carry.shape[1]) - keep
        if rows <= 0:
            return
        successors = mx.concatenate(state.carry_tokens)
        if self.model.num_mtp_blocks > 0:
            self.model.mtp_fill(
                state.carry[:, :rows], successors[None, :rows], state.mtp_cache[0], 0
            )
        state.carry = state.carry[:, rows:]
        state.carry_tokens = [successors[rows:]] if keep > 1 else []

    def prefill(self, state: Any, tokens: list[int]) -> None:
        assert isinstance(state, MTPState)
        array = mx.array(tokens)
        # Queued layer by layer, the device frees a layer's activations while the host
        # builds the next ones (docs/engine.md#tuning).
        queue_every = self.tuning.prefill_queue_every_layers
        streams = self.model.forward_hidden(array[None], state.cache, queue_every=queue_every)
        if queue_every:
            mx.async_eval(streams)  # type: ignore[no-untyped-call]
        self._carry(state, streams, array)
        self._fold(state, keep=1)
        mx.eval(state.carry, [c.state for c in state.cache], [c.state for c in state.mtp_cache])

    def step(self, state: Any, tokens: mx.array) -> mx.array:
        """A plain step: the main model only; the MTP entries wait in the carry."""
        assert isinstance(state, MTPState)
        streams = self.model.forward_hidden(tokens[None], state.cache)
        self._carry(state, streams, tokens)
        assert state.carry is not None
        if state.carry.shape[1] > MAX_CARRY:
            self._fold(state, keep=1)
            mx.async_eval([c.state for c in state.mtp_cache])  # type: ignore[no-untyped-call]
        logits: mx.array = self.model.head_from_streams(streams[:, -1:])
        return logits[0, -1]

    def propose(
        self, level: int, logits: mx.array, params: SamplingParams, key: mx.array
    ) -> mx.array:
        """The draft at `level` (0-based) from the MTP logits, lazily. Benchmarks override
        it with oracle drafts of a set acceptance (`benchmarks/mtp_cost.py`)."""
        return sample(logits, params, key)

    def _draft(
        self,
        state: MTPState,
        last_token: int,
        depth: int,
        params: SamplingParams,
        draws: Draws,
        propose: Proposer | None = None,
    ) -> tuple[list[mx.array], list[mx.array], list[int]]:
        """Lazy drafts and their logits; the first forward also folds the carry in.
        ``propose``: how a draft is drawn (default: `propose`), draft j with the key of
        its position in ``draws``."""
        assert state.carry is not None
        propose = propose or self.propose
        blocks = self.model.num_mtp_blocks
        token = mx.array([last_token])
        successors = mx.concatenate([*state.carry_tokens, token])[None]
        streams = state.carry
        drafts: list[mx.array] = []
        draft_logits: list[mx.array] = []
        used = [0] * blocks
        for level in range(depth):
            block = min(level, blocks - 1)
            logits, out = self.model.mtp_forward(streams, successors, state.mtp_cache[block], block)
            used[block] += streams.shape[1]
            last = logits[0, -1]
            successors = propose(level, last, params, draws.key(level)).reshape(1, 1)
            streams = out[:, -1:]
            drafts.append(successors.reshape(()))
            draft_logits.append(last)
        return drafts, draft_logits, used

    def _verify(self, state: MTPState, tokens: mx.array, drafts: list[mx.array]) -> mx.array:
        """`verify_streams` of `tokens` [k + 1], queued as the tuning says."""
        queue_every = self.tuning.verify_queue_every_layers
        return verify_streams(self.model, tokens[None], state.cache, drafts, queue_every)

    def speculate(
        self, state: Any, last_token: int, depth: int, params: SamplingParams, draws: Draws
    ) -> tuple[list[int], int, int]:
        """One draft + verify round; returns (tokens to emit, drafted, accepted).
        ``draws``: the keys of the round's positions (the first draft's on)."""
        assert isinstance(state, MTPState) and state.carry is not None and depth >= 1
        carried = int(state.carry.shape[1])
        drafts, draft_logits, used = self._draft(state, last_token, depth, params, draws)
        draft_ids = mx.stack(drafts)
        verify_tokens = mx.concatenate([mx.array([last_token]), draft_ids.astype(mx.int32)])
        main_streams = self._verify(state, verify_tokens, drafts)
        main_logits = self.model.head_from_streams(main_streams)[0]
        caches = [c.state for c in (*state.cache, *state.mtp_cache)]
        if params.greedy or draws.coupled:
            if params.greedy:
                targets = mx.argmax(main_logits, axis=-1)
            else:
                targets = draws.pick(mx.log(probabilities(main_logits, params)))
            mx.eval(draft_ids, targets, main_streams, caches)
            emitted = greedy_accept(_ints(draft_ids), _ints(targets))
        else:
            q = probabilities(mx.stack(draft_logits), params)
            p = probabilities(main_logits, params)
            count, final = rejection_decision(draft_ids, q, p, draws)
            mx.eval(draft_ids, count, final, main_streams, caches)
            kept = token_id(count)
            emitted = [*_ints(draft_ids)[:kept], token_id(final)]
        return _settle(state, emitted, depth, carried, used, main_streams)

    def speculate_chosen(
        self,
        state: Any,
        last_token: int,
        depth: int,
        chooser: TokenChooser,
        draws: Draws,
        remaining: int,
    ) -> tuple[list[int], int, int]:
        """`speculate` for a request with a `TokenChooser` (``remaining``: its budget):
        drafts and targets under its transforms, its grammar's masks read while the
        verify forward runs (`mlxserve.engine.spec.draft_choice`); the chooser has taken the
        emitted tokens."""
        assert isinstance(state, MTPState) and state.carry is not None and depth >= 1
        carried = int(state.carry.shape[1])
        chosen = ChosenRound(chooser, remaining)
        drafts, _, used = self._draft(
            state, last_token, depth, chooser.params, draws, propose=chosen.propose
        )
        verify_tokens = mx.concatenate([mx.array([last_token]), mx.stack(drafts)])
        main_streams = self._verify(state, verify_tokens, drafts)
        main_logits = self.model.head_from_streams(main_streams)[0]
        caches = [c.state for c in (*state.cache, *state.mtp_cache)]
        mx.async_eval(main_logits, main_streams, caches)  # type: ignore[no-untyped-call]
        emitted = chosen.verify(main_logits, draws)
        return _settle(state, emitted, depth, carried, used, main_streams)

    def measure_costs(
        self,
        tick: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> "RoundCosts":
        """The costs the automatic depth starts from (`round_costs.measure_round_costs`),
        timed by `clock`; `tick` after every probe."""
        from mlxserve.engine.spec.costs import measure_round_costs

        return measure_round_costs(self, tick=tick, clock=clock, parts=False)

    def snapshot(self, state: Any) -> MTPState:
        assert isinstance(state, MTPState)
        return copy.deepcopy(state)

    def compact(self, state: Any) -> None:
        """Layer by layer: one layer's copy in flight at a time."""
        assert isinstance(state, MTPState)
        for cache in (*state.cache, *state.mtp_cache):
            cache.compact()
        if state.carry is not None:
            (state.carry,) = own_buffers([state.carry])
        state.carry_tokens = own_buffers(state.carry_tokens)

    def nbytes(self, state: Any) -> int:
        assert isinstance(state, MTPState)
        return sum(int(getattr(c, "nbytes", 0)) for c in (*state.cache, *state.mtp_cache))


def _settle(
    state: MTPState,
    emitted: list[int],
    depth: int,
    carried: int,
    used: list[int],
    main_streams: mx.array,
) -> tuple[list[int], int, int]:
    """The end of a verified round, however its tokens were chosen: the wrong guesses
    trimmed, the kept ones carried into the next round's drafts; (emitted, drafted,
    accepted)."""
    accepted = len(emitted) - 1
    _rollback(state, depth, accepted, carried, used)
    state.carry = main_streams[:, : accepted + 1]
    state.carry_tokens = [mx.array(emitted[:accepted])] if accepted else []
    return emitted, depth, accepted


def _rollback(state: MTPState, depth: int, accepted: int, carried: int, used: list[int]) -> None:
    """Trim what the round guessed wrong: slices only, nothing is copied or computed."""
    for cache in state.cache:
        trim_exactly(cache, depth - accepted)
    # Block 0's first `carried` rows are exact (the carry); every other draft row was a guess.
    for block, rows in enumerate(used):
        trim_exactly(state.mtp_cache[block], rows - carried if block == 0 else rows)


def trim_steps(state: MTPState, n: int) -> None:
    """Undo the last `n` plain steps (for calibration)."""
    for cache in state.cache:
        trim_exactly(cache, n)
    assert state.carry is not None
    state.carry = state.carry[:, :-n]
    state.carry_tokens = state.carry_tokens[:-n]


def _ints(values: mx.array) -> list[int]:
    out = values.tolist()
    assert isinstance(out, list)
    assert all(isinstance(v, int) for v in out)
    return [int(v) for v in out]  # type: ignore[arg-type]
