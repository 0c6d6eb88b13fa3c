"""DeepSeek-V4 with its MTP drafter: prefill, plain steps and speculative rounds.

State invariant, after the main model has processed tokens x_0 .. x_{n-1}:
the main cache holds n positions; the MTP cache holds positions 0 .. n-2,
each built from the main model's streams h_p and the true next token
x_{p+1}; `carry` is h_{n-1}, waiting for x_n.

A speculative round with x_n known and depth k:
1. draft: the MTP block on (h_{n-1}, x_n) gives d_1 (this MTP entry is exact);
   on its own output streams and d_{j-1} it gives d_j (these entries are guesses);
2. verify: one main forward of [x_n, d_1 .. d_k] gives the main model's
   choice after every prefix and the streams h_n .. h_{n+k};
3. accept a drafts (greedy match or rejection sampling) plus one token;
4. roll back: the main cache drops the k - a rejected positions, the MTP cache
   its k - 1 guessed entries; the a accepted positions get exact MTP entries
   from h_n .. h_{n+a-1}; carry becomes h_{n+a}.
The draft chain and the verify forward are one lazy graph: a round costs one
evaluation plus the acceptance read-back.
"""

import copy
from typing import Any

import mlx.core as mx

from mlxserve.engine.acceptance import greedy_accept, rejection_accept
from mlxserve.engine.request import SamplingParams
from mlxserve.engine.sampling import KeyStream, probabilities, sample

MAX_DRAFT_DEPTH = 5


class MTPState:
    def __init__(self, cache: list[Any], mtp_cache: list[Any]) -> None:
        self.cache = cache
        self.mtp_cache = mtp_cache
        self.carry: mx.array | None = None  # [1, 1, hc, D]

    @property
    def offset(self) -> int:
        return int(self.cache[0].offset)


class MTPAdapter:
    """For models with `forward_hidden`, `head_from_streams` and `mtp_forward`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.max_draft_depth = MAX_DRAFT_DEPTH if model.num_mtp_blocks > 0 else 0

    def new_state(self, max_rollback: int) -> MTPState:
        return MTPState(
            self.model.make_cache(max_rollback=max_rollback),
            self.model.make_mtp_cache(max_rollback=max_rollback),
        )

    def _extend(self, state: MTPState, tokens: mx.array) -> mx.array:
        """Main forward of `tokens` [n]; MTP entries for every position whose successor is known."""
        streams = self.model.forward_hidden(tokens[None], state.cache)
        history = streams[:, :-1]
        if state.carry is not None:
            history = mx.concatenate([state.carry, history], axis=1)
            successors = tokens
        else:
            successors = tokens[1:]
        if successors.size > 0:
            # Only the MTP cache matters here; it is evaluated with the next read of it.
            self.model.mtp_forward(history, successors[None], state.mtp_cache[0], 0)
        state.carry = streams[:, -1:]
        out: mx.array = streams
        return out

    def prefill(self, state: Any, tokens: list[int]) -> None:
        assert isinstance(state, MTPState)
        self._extend(state, mx.array(tokens))
        mx.eval(state.carry, [c.state for c in state.cache], [c.state for c in state.mtp_cache])

    def step(self, state: Any, tokens: mx.array) -> mx.array:
        assert isinstance(state, MTPState)
        streams = self._extend(state, tokens)
        logits: mx.array = self.model.head_from_streams(streams[:, -1:])
        return logits[0, -1]

    def speculate(
        self, state: Any, last_token: int, depth: int, params: SamplingParams, keys: KeyStream
    ) -> tuple[list[int], int, int]:
        """One draft + verify round; returns (tokens to emit, drafted, accepted)."""
        assert isinstance(state, MTPState) and state.carry is not None
        blocks = self.model.num_mtp_blocks
        streams = state.carry
        token = mx.array([[last_token]])
        drafts: list[mx.array] = []
        draft_logits: list[mx.array] = []
        used = [0] * blocks
        for level in range(depth):
            block = min(level, blocks - 1)
            logits, streams = self.model.mtp_forward(streams, token, state.mtp_cache[block], block)
            used[block] += 1
            token = sample(logits[:, -1], params, keys.next()).reshape(1, 1)
            drafts.append(token.reshape(()))
            draft_logits.append(logits[0, -1])
        verify_tokens = mx.concatenate([mx.array([last_token]), mx.stack(drafts)])
        main_streams = self.model.forward_hidden(verify_tokens[None], state.cache)
        main_logits = self.model.head_from_streams(main_streams)[0]
        draft_ids = mx.stack(drafts)
        if params.greedy:
            targets = mx.argmax(main_logits, axis=-1)
            mx.eval(draft_ids, targets, main_streams)
            emitted = greedy_accept(_ints(draft_ids), _ints(targets))
        else:
            q = probabilities(mx.stack(draft_logits), params)
            p = probabilities(main_logits, params)
            mx.eval(draft_ids, q, p, main_streams)
            emitted = rejection_accept(_ints(draft_ids), q, p, keys)
        accepted = len(emitted) - 1
        self._rollback(state, depth, accepted, used, main_streams, emitted)
        return emitted, depth, accepted

    def _rollback(
        self,
        state: MTPState,
        depth: int,
        accepted: int,
        used: list[int],
        main_streams: mx.array,
        emitted: list[int],
    ) -> None:
        for cache in state.cache:
            cache.trim(depth - accepted)
        # Block 0's first entry (h_{n-1}, x_n) is exact; every other draft entry was a guess.
        for block, count in enumerate(used):
            guessed = count - 1 if block == 0 else count
            if guessed:
                for_block = state.mtp_cache[block]
                for_block.trim(guessed)
        if accepted:
            history = main_streams[:, :accepted]
            successors = mx.array(emitted[:accepted])[None]
            self.model.mtp_forward(history, successors, state.mtp_cache[0], 0)
        state.carry = main_streams[:, accepted : accepted + 1]
        mx.eval(state.carry, [c.state for c in state.cache], [c.state for c in state.mtp_cache])

    def snapshot(self, state: Any) -> MTPState:
        assert isinstance(state, MTPState)
        return copy.deepcopy(state)

    def nbytes(self, state: Any) -> int:
        assert isinstance(state, MTPState)
        return sum(int(getattr(c, "nbytes", 0)) for c in (*state.cache, *state.mtp_cache))


def _ints(values: mx.array) -> list[int]:
    out = values.tolist()
    assert isinstance(out, list)
    assert all(isinstance(v, int) for v in out)
    return [int(v) for v in out]  # type: ignore[arg-type]
