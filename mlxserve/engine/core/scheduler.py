"""Choose the next step: which requests run, and whether it is prefill or decode.

Requests join and leave only between steps. Running requests are capped by
`max_running`; the rest wait in arrival order. A long prompt is prefilled in
chunks, and every chunk is followed by a turn for the decoding requests, so
their streams keep flowing while a new request prefills. Short prompts share a
chunk's budget: requests that arrive together (a wave of clients) are prefilled
one after another, up to `prefill_step` tokens, before that turn, not one per
turn, so the last of sixteen does not wait sixteen decode steps for its prefill,
and the decoding requests' streams still stall for no more than one chunk.

Decoding requests share one decode step: continuous batching (the runner keeps
the batch across steps). A plain request whose prompt is in joins that step for
its first token (`_joining`); only a request starting alone takes a step of its
own for it. The speculative depth follows the batch size: a
speculative request alone drafts at its own depth (an automatic one: the depth
the engine's `depth_for` picks for the round); a small batch of speculative
requests (up to `max_speculative_batch`) drafts together at
`batch_speculative_depth`, one `speculate` step for all; a larger batch takes
plain decode steps, since there the batch already fills the forward, and drafts
again when it shrinks.
"""

from collections import deque
from collections.abc import Callable

from mlxserve.engine.core.request_state import Phase, RequestState
from mlxserve.engine.core.step import Step


class Scheduler:
    def __init__(
        self,
        max_running: int,
        prefill_step: int,
        on_admit: Callable[[RequestState], None] | None = None,
        max_speculative_batch: int = 0,
        batch_speculative_depth: int = 0,
        depth_for: Callable[[RequestState], int] | None = None,
    ) -> None:
        if max_running < 1 or prefill_step < 1:
            raise ValueError("max_running and prefill_step must be >= 1")
        self.max_running = max_running
        self.prefill_step = prefill_step
        # Called when a request starts running (the engine attaches its model state).
        self.on_admit = on_admit
        # Up to this many decoding requests that all draft speculate together, at
        # this depth (0: a batch decodes plainly).
        self.max_speculative_batch = max_speculative_batch
        self.batch_speculative_depth = batch_speculative_depth
        # The drafts of a speculative request's next round (default: its fixed depth).
        self.depth_for = depth_for or (lambda sequence: sequence.depth)
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._steps = 0
        self._decode_turn = 0
        self._decodes_since_prefill = 0
        # Prompt tokens prefilled since the last decode step: short prompts share one
        # chunk's budget (`prefill_step`) before the decoding requests get their turn.
        self._prefilled_since_decode = 0

    def add(self, sequence: RequestState) -> None:
        self.waiting.append(sequence)

    def find(self, request_id: str) -> RequestState | None:
        for sequence in (*self.running, *self.waiting):
            if sequence.request_id == request_id:
                return sequence
        return None

    def remove_finished(self) -> list[RequestState]:
        done = [s for s in (*self.running, *self.waiting) if s.phase is Phase.FINISHED]
        if not done:
            return done  # after most steps: the queues are not rebuilt
        self.running = [s for s in self.running if s.phase is not Phase.FINISHED]
        self.waiting = deque(s for s in self.waiting if s.phase is not Phase.FINISHED)
        return done

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def next_step(self) -> Step | None:
        self._admit()
        prefilling = [s for s in self.running if s.phase is Phase.PREFILL]
        decoding = [s for s in self.running if s.phase is Phase.DECODE]
        if not prefilling and not decoding:
            return None
        # Prompts done but for their last token, whose first token the plain decode step
        # of the others can take along (`_joining`).
        joining = self._joining(prefilling, decoding)
        # Up to `prefill_step` prompt tokens (a long prompt's chunk, or several short
        # prompts), then one step for every decoding request, and again.
        turn = self._decodes_since_prefill >= len(decoding)
        if prefilling and (turn or self._prefilled_since_decode > 0):
            oldest = prefilling[0]
            if turn and oldest.prompt_remaining <= 0 and not joining:
                # Only the last prompt token is left: the first decode step produces token 1.
                self._decodes_since_prefill = 0
                self._prefilled_since_decode = 0
                return self._step("decode", (oldest.request_id,), 1)
            unfilled = next((s for s in prefilling if s.prompt_remaining > 0), None)
            if unfilled is not None:
                chunk = min(self.prefill_step, unfilled.prompt_remaining)
                if turn or self._prefilled_since_decode + chunk <= self.prefill_step:
                    self._decodes_since_prefill = 0
                    self._prefilled_since_decode += chunk
                    return self._step("prefill", (unfilled.request_id,), chunk)
        self._prefilled_since_decode = 0
        together = len(decoding) > 1
        if together and self._speculate_together(decoding):
            ids = tuple(s.request_id for s in decoding)
            self._decodes_since_prefill += len(ids)
            depth = min(min(s.depth for s in decoding), self.batch_speculative_depth)
            return self._step("speculate", ids, depth)
        plain = tuple(s.request_id for s in decoding if s.depth == 0 or together)
        turns: list[tuple[str, ...]] = [plain] if plain else []
        turns += [(s.request_id,) for s in decoding if s.depth > 0 and not together]
        ids = turns[self._decode_turn % len(turns)]
        self._decode_turn += 1
        self._decodes_since_prefill += len(ids)
        if ids is plain:
            return self._step("decode", ids + tuple(s.request_id for s in joining), 1)
        sequence = next(s for s in decoding if s.request_id == ids[0])
        return self._step("speculate", ids, self.depth_for(sequence))

    @staticmethod
    def _joining(
        prefilling: list[RequestState], decoding: list[RequestState]
    ) -> list[RequestState]:
        """Plain requests whose prompt is in but for its last token, when every request
        decoding is plain: the decode step takes them along, their last prompt token as
        their input (the runner batches them, `Runner._decode_all`), rather than a
        forward of their own for their first token. That forward cost as much as the
        batch's step where weights dominate (a GPU), and a tenth of it on a small model
        on a CPU, for every request that starts. Alone (nothing decoding), a request
        takes its own step, as before: its first token as early as it can be."""
        if not decoding or any(s.depth > 0 for s in decoding):
            return []
        return [s for s in prefilling if s.prompt_remaining <= 0 and s.depth == 0]

    def _speculate_together(self, decoding: list[RequestState]) -> bool:
        """Batched speculation: every decoding request drafts, and the batch is small."""
        return (
            self.batch_speculative_depth > 0
            and len(decoding) <= self.max_speculative_batch
            and all(s.depth > 0 for s in decoding)
        )

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            sequence = self.waiting.popleft()
            sequence.phase = Phase.PREFILL
            if self.on_admit is not None:
                self.on_admit(sequence)
            self.running.append(sequence)

    def _step(self, kind: str, ids: tuple[str, ...], num_tokens: int) -> Step:
        self._steps += 1
        return Step(index=self._steps, kind=kind, request_ids=ids, num_tokens=num_tokens)  # type: ignore[arg-type]
