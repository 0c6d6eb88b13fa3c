"""Decode batches whose state lives across steps.

A batch is created when sequences start decoding together; a sequence joins it
(its prefilled state inserted) and leaves it (filtered out) between steps, and a
step runs one forward for every row without copying the batch. Two forms:

* ``CacheBatch``: mlx-lm's batched caches (``BatchKVCache`` and friends, what its
  ``BatchGenerator`` keeps). Joining ``extend``s them, leaving ``filter``s them:
  a copy per change of membership, none per step. Rows are left-padded to the
  longest, so the runner starts another batch rather than pad a short row to a
  long context (``fits``).
* ``RowBatch``: models whose per-layer caches batch as rows (DeepSeek-V4: each
  row's sliding window, compressors and indexer advance at that row's own
  position; ``LayerCache.rows``). Decode steps stack the rows' caches
  (``LayerCache.stack``) and keep them stacked across steps, so the attention
  core runs once for the batch; a joining row is stacked and appended, a
  leaving one copied out, and before a speculative round every row gets its own
  single-sequence caches back (slices, no copy).
  ``MTPRowBatch`` brings each row's MTP cache and carried streams up to date
  (in one MTP forward for the steps since the last time) before a row leaves, so
  it can speculate on its own again.
"""

from typing import Any, Protocol

import mlx.core as mx
from mlx.nn.layers.base import Module

from mlxserve.channel.request import SamplingParams
from mlxserve.engine.runner.adapter import ModelAdapter, ModelState, PlainAdapter, PlainState
from mlxserve.engine.runner.ring_cache import RingBatch, ring_capable
from mlxserve.engine.sample.acceptance import greedy_accept, rejection_accept
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import Draws, probabilities, sample
from mlxserve.engine.spec.draft_choice import ChosenRound
from mlxserve.engine.spec.mtp import MTPAdapter, trim_exactly, verify_streams

#: positions a batched KV cache grows by when full (mlx-lm's default is 256)
GROWTH_STEP = 32
#: past this padded/real size ratio a row starts another batch (see ``CacheBatch.fits``)
MAX_PADDING_RATIO = 1.5
#: ... unless the padded batch is this short: then padding costs less than a second forward
FREE_PADDED_LENGTH = 1024


class DecodeBatch(Protocol):
    """Sequences decoding one token per step in one forward."""

    def __len__(self) -> int: ...

    def fits(self, state: ModelState) -> bool:
        """Whether ``state`` may join without making the batch wasteful."""

    def join(
        self, states: list[ModelState], rooms: list[int] | None = None, expected: int = 0
    ) -> None:
        """Append rows, in order. Hints a batch may allocate for now rather than grow
        later (a copy): ``rooms``, the positions each row may still add (its remaining
        tokens); ``expected``, the rows the batch may soon hold (requests running)."""

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows (non-empty, ascending), in order."""

    def row_state(self, index: int) -> ModelState:
        """Row ``index`` as a single-sequence state of the adapter (a copy or the row)."""

    def nbytes(self) -> int:
        """The bytes of every row's caches."""

    def step(self, tokens: mx.array) -> mx.array:
        """Add one token per row (``tokens`` [B]); return the logits [B, vocab], lazily."""


class CacheBatch:
    """Rows of mlx-lm caches in a batched form.

    Full-attention ``KVCache`` layers batch as rings (``mlxserve.engine.runner.ring_cache``):
    rows join and leave in place, and nothing holds the batch twice. Other caches
    (sliding windows, state-space layers...) ``merge`` into mlx-lm's batched caches
    (``BatchKVCache``...), which copy the batch when a row joins or leaves.
    """

    def __init__(
        self,
        model: Module,
        states: list[PlainState],
        rooms: list[int] | None = None,
        expected: int = 0,
        *,
        max_reserve: int,
    ) -> None:
        self.model = model
        self.ring: RingBatch | None = None
        if all(ring_capable(state.cache) for state in states):
            caches = [s.cache for s in states]
            room = _rooms(rooms, len(states))
            self.ring = RingBatch(caches, room, expected, max_reserve=max_reserve)
            self.cache: list[Any] = list(self.ring.layers)
        else:
            self.cache = self._merge(states)
        self.lengths = [state.offset for state in states]

    @staticmethod
    def _merge(states: list[PlainState]) -> list[Any]:
        layers = zip(*(state.cache for state in states), strict=True)
        merged = [layer[0].merge(list(layer)) for layer in layers]
        for cache in merged:
            if hasattr(cache, "step"):
                # Grow in small steps: a step's growth is a copy of the batch, and its
                # unused tail is memory every row pays for.
                cache.step = GROWTH_STEP
        return merged

    def __len__(self) -> int:
        return len(self.lengths)

    def fits(self, state: ModelState) -> bool:
        longest = max(*self.lengths, state.offset)
        padded = longest * (len(self.lengths) + 1)
        real = sum(self.lengths) + state.offset
        return longest <= FREE_PADDED_LENGTH or padded <= MAX_PADDING_RATIO * max(real, 1)

    def join(
        self, states: list[ModelState], rooms: list[int] | None = None, expected: int = 0
    ) -> None:
        plain = [s for s in states if isinstance(s, PlainState)]
        assert len(plain) == len(states)
        if self.ring is not None:
            self.ring.join([s.cache for s in plain], _rooms(rooms, len(plain)), expected)
        else:
            for mine, theirs in zip(self.cache, self._merge(plain), strict=True):
                mine.extend(theirs)
        self.lengths += [state.offset for state in plain]

    def keep(self, indices: list[int]) -> None:
        if self.ring is not None:
            self.ring.keep(indices)
        else:
            rows = mx.array(indices)
            for cache in self.cache:
                cache.filter(rows)
        self.lengths = [self.lengths[i] for i in indices]

    def row_state(self, index: int) -> PlainState:
        if self.ring is not None:
            state = PlainState(self.ring.extract(index))
        else:
            state = PlainState([cache.extract(index) for cache in self.cache])
        # Evaluated now: lazily, the row's copy would hold the whole batch's buffers
        # for as long as it is kept (in the prefix cache: until evicted).
        mx.eval([c.state for c in state.cache])
        return state

    def nbytes(self) -> int:
        if self.ring is not None:
            # The rows' slots; free slots (rows the ring was sized for) are not a row's.
            return self.ring.nbytes // self.ring.layers[0].capacity * len(self)
        return sum(int(getattr(cache, "nbytes", 0)) for cache in self.cache)

    def step(self, tokens: mx.array) -> mx.array:
        if self.ring is not None:
            self.ring.ensure_room()
        logits: mx.array = self.model(tokens[:, None], cache=self.cache)
        self.lengths = [length + 1 for length in self.lengths]
        return logits[:, -1]


class RowBatch:
    """Rows whose per-layer caches batch as rows (``cache.rows``): DeepSeek-V4.

    A decode step stacks the rows' caches (``cache.stack``, where the cache offers
    it) and keeps them stacked across steps, so the attention core runs once for the
    batch rather than once per row. Joining rows are stacked onto the batch, leaving
    ones get their own caches back (copies) while the rest stay stacked; before the
    rows speculate (several tokens each) they all get their own caches back
    (``settle``, slices) and the next decode step stacks them again.
    """

    def __init__(self, model: Any, states: list[Any]) -> None:
        self.model = model
        self.states = list(states)
        self._stacked: list[Any] | None = None  # per layer, while stacked

    def __len__(self) -> int:
        return len(self.states)

    def fits(self, state: ModelState) -> bool:
        return True  # no padding

    def join(
        self, states: list[ModelState], rooms: list[int] | None = None, expected: int = 0
    ) -> None:
        if self._stacked is not None:
            joining = _stack([s.cache for s in states])  # type: ignore[attr-defined]
            ok = joining is not None and all(
                mine.compatible(theirs) for mine, theirs in zip(self._stacked, joining, strict=True)
            )
            if joining is not None and ok:
                for mine, theirs in zip(self._stacked, joining, strict=True):
                    mine.extend(theirs)
            else:
                for layer in joining or []:
                    layer.unstack()
                self.settle()
        self.states += states

    def keep(self, indices: list[int]) -> None:
        if self._stacked is not None:
            for layer in self._stacked:
                layer.take(indices)
        self.states = [self.states[i] for i in indices]

    def row_state(self, index: int) -> Any:
        """Row ``index``'s state, its caches its own (copied out of the stack, if stacked:
        a row that leaves must not keep the batch's tensors alive)."""
        for layer in self._stacked or []:
            layer.write_back(index, own=True)
        return self.states[index]

    def nbytes(self) -> int:
        caches = [c for s in self.states for c in (*s.cache, *getattr(s, "mtp_cache", ()))]
        # While stacked, the rows' own main caches hold nothing: the stacked layers do.
        caches += self._stacked or []
        return sum(int(getattr(cache, "nbytes", 0)) for cache in caches)

    def layer_rows(self, caches: list[list[Any]]) -> list[Any]:
        return [layer[0].rows(list(layer)) for layer in zip(*caches, strict=True)]

    def decode_caches(self) -> list[Any]:
        """The main caches for a one-token step: stacked when every layer stacks."""
        if self._stacked is None:
            self._stacked = _stack([state.cache for state in self.states])
        if self._stacked is not None:
            return self._stacked
        return self.layer_rows([state.cache for state in self.states])

    @property
    def stacked(self) -> bool:
        """Whether the rows' main caches are stacked now (between decode steps)."""
        return self._stacked is not None

    def settle(self) -> None:
        """Give every row its own caches back (slices of the stacked state)."""
        if self._stacked is not None:
            for layer in self._stacked:
                layer.unstack()
            self._stacked = None

    def step(self, tokens: mx.array) -> mx.array:
        logits: mx.array = self.model(tokens[:, None], cache=self.decode_caches())
        return logits[:, -1]


class MTPRowBatch(RowBatch):
    """``RowBatch`` for ``MTPAdapter`` states (main cache, MTP caches, carried streams).

    While rows decode in the batch nobody drafts, so the MTP block does not run per
    step: each step only records what its cache entries are built from (the streams
    carried into the step and the token fed). ``flush`` builds those entries for
    every row at once over the backlog (``mtp_fill``: the block's K=V rows, not its
    whole forward), which restores the state
    invariant of ``mtp_adapter`` (the MTP cache holds every position but the last,
    ``carry`` is the last position's streams) before a row leaves or the batch
    changes, and every ``MAX_BACKLOG`` steps, or sooner when the backlog holds
    ``MAX_BACKLOG_TOKENS`` (rows x steps): a flush's activations grow with the tokens
    it runs (when a flush ran the whole block, a 16-step one at 8 rows held 0.8 MB on
    the demo, a quarter of its weights, for caches of 0.3 MB).
    """

    MAX_BACKLOG = 16
    MAX_BACKLOG_TOKENS = 32

    def __init__(self, model: Any, states: list[Any], queue_every: int) -> None:
        super().__init__(model, [])
        self.queue_every = queue_every  # the verify's (`verify_streams`)
        self._carry: mx.array | None = None  # [B, 1, hc, D]: the rows' carried streams
        self._history: list[mx.array] = []  # per step, the streams carried into it
        self._fed: list[mx.array] = []  # per step, the tokens fed [B]
        self.join(states)

    def join(
        self, states: list[ModelState], rooms: list[int] | None = None, expected: int = 0
    ) -> None:
        self.flush()
        for state in states:
            _fold_carry(self.model, state)
        super().join(states)

    def keep(self, indices: list[int]) -> None:
        self.flush()
        super().keep(indices)

    def row_state(self, index: int) -> Any:
        self.flush()
        return super().row_state(index)

    def step(self, tokens: mx.array) -> mx.array:
        if self._carry is None:
            self._carry = mx.concatenate([s.carry for s in self.states], axis=0)
        streams = self.model.forward_hidden(tokens[:, None], self.decode_caches())
        self._history.append(self._carry)
        self._fed.append(tokens)
        self._carry = streams[:, -1:]
        logits: mx.array = self.model.head_from_streams(self._carry)
        steps = len(self._fed)
        if steps >= self.MAX_BACKLOG or steps * len(self.states) >= self.MAX_BACKLOG_TOKENS:
            self.flush()
        return logits[:, -1]

    def flush(self) -> None:
        """Build the MTP entries of the steps since the last flush, for every row."""
        if not self._fed:
            return
        assert self._carry is not None
        history = mx.concatenate(self._history, axis=1)
        successors = mx.stack(self._fed, axis=1)
        mtp_cache = self.layer_rows([s.mtp_cache[:1] for s in self.states])[0]
        self.model.mtp_fill(history, successors, mtp_cache, 0)
        for index, state in enumerate(self.states):
            state.carry = self._carry[index : index + 1]
            state.carry_tokens = []
        self._history, self._fed, self._carry = [], [], None
        # Queued, not waited for: a flush comes inside a step, and waiting here would
        # finish that step's forward before the next one is built (a stalled pipeline
        # every few steps on a GPU). Queuing still bounds the backlog's lazy graph.
        mx.async_eval(  # type: ignore[no-untyped-call]
            [s.carry for s in self.states], [c.state for s in self.states for c in s.mtp_cache]
        )

    def speculate(
        self,
        last: list[int],
        depth: int,
        params: list[SamplingParams],
        keys: list[Draws],
        choosers: list[TokenChooser | None] | None = None,
        budgets: list[int] | None = None,
    ) -> list[list[int] | Exception]:
        """One draft + verify round for every row at once; the tokens each row emits
        (``keys``: the keys of each row's positions, from its first draft's on).

        ``last`` holds each row's last emitted token, not yet in its caches. The MTP
        block drafts ``depth`` tokens for all rows together (one forward per level),
        the main model verifies ``[last, drafts]`` for all rows in one forward, each
        row accepts its own prefix (greedy match or rejection sampling), and each row
        rolls back on its own: its caches drop what it rejected. The MTP entries of
        the verified positions are built for all rows in one forward and trimmed per
        row. The same round as ``MTPAdapter.speculate``, row by row.

        A row with a `TokenChooser` (``choosers``, with its ``budgets``) drafts and
        verifies under its transforms (`mlxserve.engine.spec.draft_choice`); where its
        own work fails (its grammar...), its entry is the exception and the other rows
        go on (its caches are rolled back as if it kept no draft).
        """
        rounds = [
            ChosenRound(chooser, budget) if chooser is not None else None
            for chooser, budget in zip(
                choosers or [None] * len(last), budgets or [0] * len(last), strict=True
            )
        ]
        self.flush()
        self.settle()
        model, states = self.model, self.states
        blocks = model.num_mtp_blocks
        streams = mx.concatenate([s.carry for s in states], axis=0)
        first = mx.array(last, dtype=mx.int32)[:, None]
        token = first
        drafts: list[mx.array] = []
        draft_logits: list[mx.array] = []
        used = [0] * blocks
        for level in range(depth):
            block = min(level, blocks - 1)
            rows = self.layer_rows([s.mtp_cache[block : block + 1] for s in states])[0]
            logits, streams = model.mtp_forward(streams, token, rows, block)
            used[block] += 1
            token = _draft_rows(level, logits[:, -1], params, keys, rounds)[:, None]
            drafts.append(token)
            draft_logits.append(logits[:, -1])
        draft_ids = mx.concatenate(drafts, axis=1)  # [B, k]
        verify = mx.concatenate([first, draft_ids], axis=1)  # [B, k + 1]
        rows = self.layer_rows([s.cache for s in states])
        main_streams = verify_streams(model, verify, rows, drafts, self.queue_every)
        main_logits = model.head_from_streams(main_streams)  # [B, k + 1, V]
        emitted = self._accept(
            draft_ids, draft_logits, main_logits, main_streams, params, keys, rounds
        )
        kept = [tokens if isinstance(tokens, list) else [0] for tokens in emitted]
        self._rollback(depth, used, kept, main_streams, verify)
        return emitted

    def _accept(
        self,
        draft_ids: mx.array,
        draft_logits: list[mx.array],
        main_logits: mx.array,
        main_streams: mx.array,
        params: list[SamplingParams],
        keys: list[Draws],
        rounds: list[ChosenRound | None],
    ) -> list[list[int] | Exception]:
        """One host read for the whole batch (plus one or two per sampled or chosen row)."""
        targets = mx.argmax(main_logits, axis=-1)
        # A seeded sampled row's targets: its positions' draws (coupled, as plain steps).
        drawn = {
            row: keys[row].pick(mx.log(probabilities(main_logits[row], sampling)))
            for row, sampling in enumerate(params)
            if not sampling.greedy and keys[row].coupled and rounds[row] is None
        }
        if drawn:
            targets = mx.stack([drawn.get(row, targets[row]) for row in range(len(params))])
        mx.eval(draft_ids, targets, main_streams)
        drafted = _int_rows(draft_ids)
        argmaxes = _int_rows(targets)
        out: list[list[int] | Exception] = []
        for row, sampling in enumerate(params):
            row_drafts = drafted[row]
            chosen = rounds[row]
            if chosen is not None:
                try:
                    out.append(chosen.verify(main_logits[row], keys[row]))
                except Exception as exc:  # the row's own work: the others go on
                    out.append(exc)
                continue
            if sampling.greedy or keys[row].coupled:
                out.append(greedy_accept(row_drafts, argmaxes[row]))
                continue
            q = probabilities(mx.stack([logits[row] for logits in draft_logits]), sampling)
            p = probabilities(main_logits[row], sampling)
            out.append(rejection_accept(row_drafts, q, p, keys[row]))
        return out

    def _rollback(
        self,
        depth: int,
        used: list[int],
        emitted: list[list[int]],
        main_streams: mx.array,
        verify: mx.array,
    ) -> None:
        for state, tokens in zip(self.states, emitted, strict=True):
            rejected = depth - (len(tokens) - 1)
            for cache in state.cache:
                trim_exactly(cache, rejected)
            # Block 0's first entry (h_{n-1}, x_n) is exact; the other draft entries
            # were guesses.
            for block, count in enumerate(used):
                guessed = count - 1 if block == 0 else count
                if guessed:
                    trim_exactly(state.mtp_cache[block], guessed)
        # Entries (h_{n+j}, x_{n+j+1}) for j < depth, for every row in one forward (the
        # verified tokens are the accepted drafts up to each row's first rejection);
        # each row then drops the entries past its accepted ones.
        accepted = [len(tokens) - 1 for tokens in emitted]
        if depth > 0 and any(accepted):
            mtp_rows = self.layer_rows([s.mtp_cache[:1] for s in self.states])[0]
            self.model.mtp_fill(main_streams[:, :depth], verify[:, 1:], mtp_rows, 0)
            for state, count in zip(self.states, accepted, strict=True):
                trim_exactly(state.mtp_cache[0], depth - count)
        for row, (state, count) in enumerate(zip(self.states, accepted, strict=True)):
            state.carry = main_streams[row : row + 1, count : count + 1]
            state.carry_tokens = []
        mx.eval(
            [s.carry for s in self.states],
            [c.state for s in self.states for c in (*s.cache, *s.mtp_cache)],
        )


def _fold_carry(model: Any, state: Any) -> None:
    """Make a row's pending MTP entries (``MTPAdapter`` lets plain steps defer them in
    ``carry`` / ``carry_tokens``) so its carry is the last position's streams alone."""
    rows = int(state.carry.shape[1]) - 1
    if rows > 0:
        successors = mx.concatenate(state.carry_tokens)[None, :rows]
        model.mtp_fill(state.carry[:, :rows], successors, state.mtp_cache[0], 0)
        state.carry = state.carry[:, rows:]
    state.carry_tokens = []


def _int_rows(values: mx.array) -> list[list[int]]:
    rows = values.tolist()
    assert isinstance(rows, list)
    return [[int(v) for v in row] for row in rows]  # type: ignore[union-attr, arg-type]


def _draft_rows(
    level: int,
    logits: mx.array,
    params: list[SamplingParams],
    keys: list[Draws],
    rounds: list[ChosenRound | None],
) -> mx.array:
    """Draft ``level`` of every row from ``logits`` [B, V], each with its request's
    sampling and its position's key; a row with a chooser under its transforms."""
    if all(p.greedy for p in params) and not any(rounds):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.stack(
        [
            chosen.propose(level, logits[i], p, k.key(level))
            if chosen is not None
            else sample(logits[i], p, k.key(level)).astype(mx.int32)
            for i, (p, k, chosen) in enumerate(zip(params, keys, rounds, strict=True))
        ]
    )


def _rooms(rooms: list[int] | None, count: int) -> list[int | None]:
    return [None] * count if rooms is None else list(rooms)


def new_batch(
    adapter: ModelAdapter,
    states: list[ModelState],
    rooms: list[int] | None = None,
    expected: int = 0,
) -> DecodeBatch | None:
    """A batch of ``states`` when the adapter's model and caches allow one, else None
    (``rooms``, ``expected``: as in ``DecodeBatch.join``)."""
    model = getattr(adapter, "model", None)
    if model is None or not states:
        return None
    if isinstance(adapter, MTPAdapter):
        ok = all(
            getattr(s, "carry", None) is not None
            and _rows_capable(s.cache)  # type: ignore[attr-defined]
            and _rows_capable(s.mtp_cache[:1])  # type: ignore[attr-defined]
            and len(s.mtp_cache) > 0  # type: ignore[attr-defined]
            for s in states
        )
        queue_every = adapter.tuning.verify_queue_every_layers
        return MTPRowBatch(model, states, queue_every) if ok else None
    if not isinstance(adapter, PlainAdapter):
        return None
    plain = [s for s in states if isinstance(s, PlainState)]
    if len(plain) != len(states) or not plain[0].cache:
        return None
    if all(_rows_capable(s.cache) for s in plain):
        return RowBatch(model, plain)
    if all(callable(getattr(c, "merge", None)) for s in plain for c in s.cache):
        reserve = adapter.tuning.batch_reserve_positions
        return CacheBatch(model, plain, rooms, expected, max_reserve=reserve)
    return None


def can_join(batch: DecodeBatch, state: ModelState) -> bool:
    """Whether ``state`` is of the batch's form (else it needs its own batch or none)."""
    if isinstance(batch, MTPRowBatch):
        return getattr(state, "carry", None) is not None and _rows_capable(
            getattr(state, "cache", [])
        )
    if isinstance(batch, RowBatch):
        return isinstance(state, PlainState) and _rows_capable(state.cache)
    if isinstance(batch, CacheBatch):
        return isinstance(state, PlainState) and all(
            callable(getattr(c, "merge", None)) for c in state.cache
        )
    return False


def _stack(caches: list[list[Any]]) -> list[Any] | None:
    """Every layer of these rows stacked (``cache.stack``), or None when one cannot be
    (its rows then keep their own caches)."""
    layers = [list(layer) for layer in zip(*caches, strict=True)]
    if not all(callable(getattr(layer[0], "stack", None)) for layer in layers):
        return None
    if not all(layer[0].can_stack(layer) for layer in layers):
        return None
    return [layer[0].stack(layer) for layer in layers]


def _rows_capable(caches: list[Any]) -> bool:
    return bool(caches) and all(callable(getattr(c, "rows", None)) for c in caches)
