"""Run one step plan on the model and turn the result into tokens per request.

Plain decoding is pipelined like `mlx_lm.generate`: the next forward is
queued (`mx.async_eval`) before the current token is read back, so the host
and the device overlap. A decode plan naming several requests runs them as one
batch when the adapter can (`BatchingAdapter`): continuous batching, since
requests join and leave the batch between any two steps. Speculative steps are
delegated to the adapter.
"""

import logging
import time

import mlx.core as mx

from mlxserve.engine.adapter import ModelAdapter
from mlxserve.engine.depth import DepthChooser
from mlxserve.engine.prefix_cache import PrefixCache
from mlxserve.engine.sampling import sample, token_id
from mlxserve.engine.sequence import Phase, Sequence
from mlxserve.engine.step_plan import StepPlan

log = logging.getLogger(__name__)

#: A batch pads every cache to its longest; past this padded/real ratio, split it.
MAX_PADDING_RATIO = 1.5


def length_groups(sequences: list[Sequence]) -> list[list[Sequence]]:
    """Split into batches of similar context length (neighbours after sorting).

    The batched caches are left-padded to the longest member, so one 30k-token
    context among short ones would make every row 30k long; a group is closed when
    adding the next (longer) sequence would push padded/real size past
    ``MAX_PADDING_RATIO``.
    """
    lengths = {id(s): max(s.state.offset if s.state else 0, 1) for s in sequences}
    groups: list[list[Sequence]] = []
    total = 0
    for sequence in sorted(sequences, key=lambda s: lengths[id(s)]):
        length = lengths[id(sequence)]
        group = groups[-1] if groups else None
        if group is not None and length * (len(group) + 1) <= MAX_PADDING_RATIO * (total + length):
            group.append(sequence)
            total += length
        else:
            groups.append([sequence])
            total = length
    return groups


class Runner:
    def __init__(self, adapter: ModelAdapter, prefix_cache: PrefixCache | None) -> None:
        self.adapter = adapter
        self.prefix_cache = prefix_cache
        # Set by the engine when a request chooses its depth per round.
        self.chooser: DepthChooser | None = None

    def run(self, plan: StepPlan, sequences: list[Sequence]) -> dict[str, list[int]]:
        """Execute `plan`; returns the tokens each request emits in this step."""
        emitted: dict[str, list[int]] = {}
        if plan.kind == "decode" and len(sequences) > 1:
            return self._decode_many(sequences)
        for sequence in sequences:
            if plan.kind == "prefill":
                self._prefill(sequence, plan.num_tokens)
            elif plan.kind == "decode":
                emitted[sequence.request_id] = self._decode(sequence)
            else:
                emitted[sequence.request_id] = self._speculate(sequence, plan.num_tokens)
        return emitted

    def attach_state(self, sequence: Sequence) -> None:
        """Give a starting request its model state: a prefix-cache hit or a fresh one."""
        if sequence.state is not None:
            return
        hit = self.prefix_cache.lookup(sequence.prompt) if self.prefix_cache else None
        if hit is not None:
            sequence.state, sequence.prefilled = hit
            sequence.cached_tokens = sequence.prefilled
        else:
            sequence.state = self.adapter.new_state(max_rollback=sequence.depth)

    def _prefill(self, sequence: Sequence, count: int) -> None:
        assert sequence.state is not None
        count = min(count, sequence.prompt_remaining)
        start = sequence.prefilled
        self.adapter.prefill(sequence.state, list(sequence.prompt[start : start + count]))
        sequence.prefilled += count

    def _first_logits(self, sequence: Sequence) -> mx.array:
        """Run the last prompt token; the state is stored for prefix reuse just before."""
        assert sequence.state is not None
        if self.prefix_cache is not None and sequence.prefilled > sequence.cached_tokens:
            self.prefix_cache.store(sequence.prompt[: sequence.prefilled], sequence.state)
        sequence.phase = Phase.DECODE
        return self.adapter.step(sequence.state, mx.array(sequence.prompt[-1:]))

    def _decode(self, sequence: Sequence) -> list[int]:
        params = sequence.request.sampling
        if sequence.pending is None:
            sequence.pending = sample(self._first_logits(sequence), params, sequence.keys.next())
            if sequence.depth > 0:
                # Speculative requests take their first token plainly, then draft.
                token = token_id(sequence.pending)
                sequence.pending = None
                return [token]
        assert sequence.state is not None
        current = sequence.pending
        if sequence.budget > 1:
            logits = self.adapter.step(sequence.state, current.reshape(1))
            sequence.pending = sample(logits, params, sequence.keys.next())
            mx.async_eval(sequence.pending)  # type: ignore[no-untyped-call]
        else:
            sequence.pending = None
        return [token_id(current)]

    def _decode_many(self, sequences: list[Sequence]) -> dict[str, list[int]]:
        """Batch the sequences in steady decoding; the others take their own step."""
        steady = [s for s in sequences if s.pending is not None and s.depth == 0 and s.budget > 1]
        can_batch = getattr(self.adapter, "can_batch", None)
        if can_batch is None or not can_batch([s.state for s in steady]):
            steady = []
        batched = {id(s) for s in steady}
        emitted = {s.request_id: self._decode(s) for s in sequences if id(s) not in batched}
        for group in length_groups(steady):
            if len(group) == 1:
                emitted[group[0].request_id] = self._decode(group[0])
                continue
            try:
                emitted.update(self._decode_batch(group))
            except Exception:
                # An error while building the batched step (the caches are replaced
                # only once the forward is built): one by one, a failure stays with
                # the request that causes it. A later, lazy failure fails the plan.
                log.exception("batched decode of %d requests failed; one by one", len(group))
                emitted.update({s.request_id: self._decode(s) for s in group})
        return emitted

    def _decode_batch(self, group: list[Sequence]) -> dict[str, list[int]]:
        current = [s.pending for s in group]
        tokens = mx.concatenate([token.reshape(1) for token in current if token is not None])
        assert tokens.shape[0] == len(group)
        logits = self.adapter.step_batch([s.state for s in group], tokens)  # type: ignore[attr-defined]
        for index, sequence in enumerate(group):
            params = sequence.request.sampling
            sequence.pending = sample(logits[index], params, sequence.keys.next())
        mx.async_eval([s.pending for s in group])  # type: ignore[no-untyped-call]
        emitted = {}
        for sequence, token in zip(group, current, strict=True):
            assert token is not None
            emitted[sequence.request_id] = [token_id(token)]
        return emitted

    def _speculate(self, sequence: Sequence, depth: int) -> list[int]:
        """A round at `depth` drafts; with an automatic depth, 0 is a pipelined plain step.

        Plain steps leave the next token pending (sampled, not yet read); a round
        that follows them reads it first and drafts after it.
        """
        assert sequence.state is not None and sequence.generated
        drafter = getattr(self.adapter, "speculate", None)
        if depth <= 0 or drafter is None:
            started = time.perf_counter()
            if sequence.pending is None:
                logits = self.adapter.step(sequence.state, mx.array(sequence.generated[-1:]))
                sequence.pending = sample(logits, sequence.request.sampling, sequence.keys.next())
                mx.async_eval(sequence.pending)  # type: ignore[no-untyped-call]
                clean = False
            else:
                clean = True
            tokens = self._decode(sequence)
            sequence.stats.count_step(0)
            sequence.plain_streak += 1
            if clean and sequence.pending is not None:
                self._observe(0, time.perf_counter() - started)
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
            token = sample(logits, sequence.request.sampling, sequence.keys.next())
            return [*first, token_id(token)]
        started = time.perf_counter()
        tokens, drafted, accepted = drafter(
            sequence.state, last, depth, sequence.request.sampling, sequence.keys
        )
        if not first:
            # After plain steps the first draft also folds their MTP entries in: a
            # dearer round than the steady ones, so it is not timed.
            self._observe(depth, time.perf_counter() - started)
        sequence.stats.record(drafted, accepted)
        sequence.plain_streak = 0
        if self.chooser is not None:
            self.chooser.record(drafted, accepted)
        return [*first, *tokens]

    def _observe(self, depth: int, seconds: float) -> None:
        if self.chooser is not None:
            self.chooser.observe(depth, seconds)
