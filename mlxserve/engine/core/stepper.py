"""The stepper: `Engine` holds the model and its requests and runs them one step at a time.

Clients call `submit` and `cancel` from any thread; `run_once`, on the one
thread that owns the model, picks them up at step boundaries, asks the
scheduler for a step, runs it, and delivers tokens and finish events to
each request's stream. That thread is the engine process's `EngineLoop`
(`mlxserve.engine.process.loop`), or a caller that steps the engine itself
(`mlxserve.engine.core.drive`, tests). `progress` counts finished steps, which
is what the watchdog watches. Under tensor parallelism rank 0's engine has a
`LockstepLeader` and the other ranks follow it (`mlxserve.engine.process.lockstep`).
"""

import dataclasses
import logging
import queue
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxserve.engine.core.prefix_cache import PrefixCache
from mlxserve.engine.core.request import (
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    TokensEvent,
    Usage,
)
from mlxserve.engine.core.request_state import Phase, RequestState
from mlxserve.engine.core.scheduler import Scheduler
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.step_times import StepTimes
from mlxserve.engine.runner.adapter import (
    ModelAdapter,
    SupportsAdaptiveVerification,
    SupportsSpeculation,
)
from mlxserve.engine.runner.runner import Runner
from mlxserve.engine.sample.ending import Ending
from mlxserve.engine.sample.grammar import Grammars
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import KeyStream
from mlxserve.engine.spec.cost_store import (
    CostsKey,
    CostsPlace,
    load_acceptance,
    load_costs,
    save_acceptance,
    save_costs,
)
from mlxserve.engine.spec.costs import RoundCosts
from mlxserve.engine.spec.depth import DepthPicker
from mlxserve.hardware.clock import cost_clock, observed_times_comparable
from mlxserve.hardware.tuning import EngineTuning, default_tuning

if TYPE_CHECKING:
    from mlxserve.engine.process.lockstep import LockstepLeader

log = logging.getLogger(__name__)

StepHook = Callable[[Step], None]

#: The depth of a request with an automatic depth until the depth picker is calibrated.
FIRST_DEPTH = 2
#: A server writes its depth picker's acceptance counts for later runs at most this
#: often (`Engine._keep_acceptance`): a small file, never once per request.
KEEP_ACCEPTANCE_EVERY_S = 60.0


@dataclass(frozen=True)
class _Submit:
    request: GenerationRequest
    stream: "RequestStream"


@dataclass(frozen=True)
class _Cancel:
    request_id: str


_Message = _Submit | _Cancel | None


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 16
    prefill_step: int = 512
    # 0: off; 1-5: drafts per round; "auto": chosen per round (`mlxserve.engine.spec.depth`)
    speculative_depth: int | Literal["auto"] = 0
    prefix_cache_entries: int = 16
    prefix_cache_bytes: int = 1 << 30
    # Batched speculation: up to this many requests draft together, at this depth
    # (serving: the tuning's, resolved by `mlxserve.engine.core.build.engine_config`).
    max_speculative_batch: int = 0
    batch_speculative_depth: int = 0
    # The least time any step is allowed (`StepTimes.floor_s`), not only a step on
    # new shapes: on CUDA 1.25 s, where any new shape compiles, in a step or between
    # steps, too many to track; 0 where nothing compiles (a CPU, Metal).
    step_floor_s: float = 0.0
    # The knobs the adapter and the model run with; the engine tunes them with these.
    tuning: EngineTuning = field(default_factory=default_tuning)
    # Where measured round costs are kept across runs (`mlxserve.engine.spec.cost_store`);
    # None: measured by every engine (tests, benchmarks, a follower rank: rank 0 decides).
    round_costs: CostsPlace | None = None


class RequestStream:
    """The events of one request, in order, ending with a `FinishEvent`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()

    def put(self, event: Event) -> None:
        self._events.put(event)

    def get(self, timeout: float | None = None) -> Event:
        return self._events.get(timeout=timeout)

    def ready(self) -> list[Event]:
        """The events waiting now, without blocking (none: an empty list)."""
        events: list[Event] = []
        while not self._events.empty():
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        return events

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self._events.get()
            yield event
            if isinstance(event, FinishEvent):
                return


def _weights_bytes(adapter: ModelAdapter) -> int:
    model = getattr(adapter, "model", None)
    if model is None:
        return 0
    arrays = tree_flatten(model.parameters())
    assert isinstance(arrays, list)
    return sum(int(array.nbytes) for _, array in arrays)


class Engine:
    def __init__(
        self,
        adapter: ModelAdapter,
        config: EngineConfig,
        before_step: StepHook | None = None,
        lockstep: "LockstepLeader | None" = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.adapter = adapter
        adapter.tune(config.tuning)
        self.grammars = grammars
        self.lockstep = lockstep
        self._weights_bytes = _weights_bytes(adapter)
        self.config = config
        auto = config.speculative_depth == "auto"
        wanted = adapter.max_draft_depth if auto else int(config.speculative_depth)
        self.depth = min(wanted, adapter.max_draft_depth)
        # Automatic depth: per request and round, from acceptance and measured costs.
        self.auto = auto and self.depth > 0
        self.depth_picker: DepthPicker | None = None
        # Round-cost measurements this engine ran (a stored calibration is not one).
        self.calibrations = 0
        # A follower rank: the costs rank 0 sent with the step it is about to run
        # (`lockstep.follow`); None when rank 0 measures in that step.
        self.leader_costs: RoundCosts | None = None
        # A follower rank (`lockstep.follow`): as on rank 0, a step that raised is the
        # group's failure, and ends the rank rather than failing the step's requests.
        self.follows_group = False
        # Whether `_depth_for` has looked for a kept calibration (once per engine).
        self._looked_for_stored = False
        cache = None
        if config.prefix_cache_entries > 0:
            cache = PrefixCache(adapter, config.prefix_cache_entries, config.prefix_cache_bytes)
        self.prefix_cache = cache
        self.runner = Runner(adapter, cache)
        self.scheduler = Scheduler(
            config.max_running,
            config.prefill_step,
            on_admit=self.runner.attach_state,
            max_speculative_batch=config.max_speculative_batch,
            batch_speculative_depth=config.batch_speculative_depth,
            depth_for=self._depth_for,
        )
        self.before_step = before_step
        # Called on this thread at the end of every `run_once`: the engine process sends
        # what the step emitted there, in one write (`engine.process.socket_end`), rather
        # than waking a thread per request and token.
        self.deliver: Callable[[], None] | None = None
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        # Follower ranks: the streams of the mirrored requests still running.
        self.mirrored: dict[str, RequestStream] = {}
        # Read by the watchdog from another thread: plain attributes, written only here.
        self.progress = 0
        self.current_step: Step | None = None
        self.step_started_at = 0.0
        # Set while the engine warms up (`mlxserve.engine.process.warmup`), on a follower
        # while it runs rank 0's warm-up steps: the watchdog allows such steps longer.
        self.warming_up = False
        # When the depth picker's acceptance was last written (`_keep_acceptance`).
        self._acceptance_kept_at: float | None = None
        self._acceptance_kept: tuple[list[int], list[int]] | None = None
        self.step_times = StepTimes(floor_s=config.step_floor_s)
        # MLX's peak is reset whenever the engine goes idle (`_idle`): `busy_peak_bytes`
        # is then the peak of the current busy period, `_serving_peak` the ones before.
        self._serving_peak = 0
        self._busy = False

    # -- client side (any thread) ------------------------------------------

    def submit(
        self, request: GenerationRequest, stream: RequestStream | None = None
    ) -> RequestStream:
        """Queue ``request``; its events go to ``stream`` (default: a new one of its own)."""
        stream = RequestStream(request.request_id) if stream is None else stream
        self._inbox.put(_Submit(request, stream))
        return stream

    def cancel(self, request_id: str) -> None:
        self._inbox.put(_Cancel(request_id))

    def wake(self) -> None:
        """Wake a `run_once(block=True)` that waits for work (its loop is stopping)."""
        self._inbox.put(None)

    @property
    def queue_depth(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    # -- the engine thread ---------------------------------------------------

    def run_once(self, block: bool = False) -> bool:
        """Take in new work and run at most one step; False when there was nothing to run.
        Then `deliver`, if set, hands on what the streams got."""
        try:
            self.keep_finished()
            if self.scheduler.idle:
                self._idle()  # before waiting for work: the next request starts a new period
            self._drain_inbox(block=block and self.scheduler.idle)
            step = self.scheduler.next_step()
            if step is None:
                self._idle()
                return False
            self._busy = True
            self._run(step)
            return True
        finally:
            if self.deliver is not None:
                self.deliver()

    def forget_warm_up(self) -> None:
        """Keep nothing of requests run before serving (`mlxserve.engine.process.warmup`) but
        compiled kernels and the depth calibration: no prefix-cache entries, step
        times, memory peaks or acceptance and round times. Rank 0 of a tensor-parallel
        group tells its followers, which forget theirs too (`lockstep.follow`)."""
        if self.lockstep is not None:
            self.lockstep.warm_up_over()
        self.runner.drop_finished()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.step_times.clear()
        if self.depth_picker is not None:
            self.depth_picker.forget_observations()
        self._busy = False
        self._serving_peak = 0
        mx.reset_peak_memory()

    def _idle(self) -> None:
        """Nothing runs: the busy period's peak memory is over (kept in the serving peak)."""
        if self._busy:
            self._busy = False
            self._serving_peak = max(self._serving_peak, int(mx.get_peak_memory()))
            mx.reset_peak_memory()

    # -- follower ranks (their own loop: `lockstep.follow`) -------------------

    def admit_mirrored(self, request: GenerationRequest) -> None:
        """Admit a request rank 0 admitted; its events go to `mirrored[request_id]`."""
        stream = RequestStream(request.request_id)
        self.mirrored[request.request_id] = stream
        self._admit(request, stream)

    def cancel_now(self, request_id: str) -> None:
        self._handle(_Cancel(request_id))

    def keep_finished(self) -> None:
        """Keep the states of requests finished in the last step for prefix reuse, now
        that their finish events have gone out; before any new request is taken in,
        which a follower rank does too (`lockstep.follow`), so every rank's prefix
        cache holds the same entries."""
        self.runner.keep_finished()

    def run_step(self, step: Step) -> None:
        self._run(step)

    def _drain_inbox(self, block: bool) -> None:
        if not block and self._inbox.empty():
            return  # every step: no exception raised (and caught) when nothing came
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, message: _Message) -> None:
        if isinstance(message, _Submit):
            request = message.request
            if self.lockstep is not None and request.params.sampling.seed is None:
                # Every rank must draw the same samples: the seed travels with the request.
                request = request.with_seed(secrets.randbits(63))
            if self._admit(request, message.stream) and self.lockstep is not None:
                self.lockstep.admitted(request)
        elif isinstance(message, _Cancel):
            sequence = self.scheduler.find(message.request_id)
            if sequence is not None:
                self._finish(sequence, "cancelled")
                self.scheduler.remove_finished()
                self.runner.settle()
                if self.lockstep is not None:
                    self.lockstep.cancelled(message.request_id)

    def _admit(self, request: GenerationRequest, stream: RequestStream) -> bool:
        if request.request_id in self._streams:
            usage = Usage(prompt_tokens=len(request.params.prompt_ids), completion_tokens=0)
            error = f"request id {request.request_id!r} is already in flight"
            stream.put(FinishEvent(request.request_id, "error", usage, None, error))
            return False
        # A seeded request may take any depth: its tokens are its depth-0 ones (coupled
        # draws, `mlxserve.engine.sample.sampling`), so timings do not change them.
        auto = self.auto and request.speculative_depth is None
        depth = self.depth if request.speculative_depth is None else request.speculative_depth
        depth = max(0, min(depth, self.adapter.max_draft_depth))
        chooser = None
        if request.needs_chooser:
            try:
                chooser = self._chooser(request)
            except ValueError as exc:
                usage = Usage(prompt_tokens=len(request.params.prompt_ids), completion_tokens=0)
                stream.put(FinishEvent(request.request_id, "error", usage, None, str(exc)))
                return False
        sequence = RequestState(
            request=request,
            keys=KeyStream(request.params.sampling.seed),
            depth=depth,
            auto=auto,
            chooser=chooser,
            rollback=self.depth,
        )
        sequence.stats.depth = "auto" if auto else depth
        self._streams[request.request_id] = stream
        self.scheduler.add(sequence)
        return True

    def _chooser(self, request: GenerationRequest) -> TokenChooser:
        params = request.params
        grammar = ending = None
        if params.grammar is not None or params.reasoning is not None:
            if self.grammars is None:
                raise ValueError("this engine has no tokenizer for grammars")
            if params.grammar is not None:
                grammar = self.grammars.compile(params.grammar)
            closing = self.grammars.closing() if grammar is not None else None
            vocab = self.grammars.vocab_size
            ending = Ending(params.reasoning, params.stop_token_ids, closing, vocab)
        return TokenChooser(params.sampling, grammar, params.grammar_prefix, ending)

    def _calibrate(self, stored: RoundCosts | None) -> DepthPicker:
        """The depth picker, on the costs ``stored`` (kept by an earlier run, or sent
        by rank 0), else on costs timed now, once, inside the first speculative step
        of a request with an automatic depth: under tensor parallelism every rank runs
        that step, so the calibration's forwards (and their collectives) line up on
        all ranks. Measured costs are kept for later runs (`config.round_costs`)."""
        adapter = self.adapter
        assert isinstance(adapter, SupportsSpeculation), "an automatic depth needs a drafter"
        clock = cost_clock()
        if stored is not None:
            costs, how = stored, "stored"
        else:
            costs, how = adapter.measure_costs(tick=self._count_progress, clock=clock), "measured"
            self.calibrations += 1
            place = self.config.round_costs
            if place is not None:
                path = save_costs(place.state_dir, self._costs_key(place), costs)
                how = f"measured, kept in {path}" if path is not None else how
        log.info(
            "speculative round costs (ms, %s): plain step %.2f, rounds %s",
            how,
            costs.plain * 1e3,
            {k: round(costs.round(k) * 1e3, 2) for k in range(1, self.depth + 1)},
        )
        picker = DepthPicker(
            max_depth=self.depth, calibrated=costs, follow_observed=observed_times_comparable()
        )
        place = self.config.round_costs
        if place is not None and not self.follows_group:
            kept = load_acceptance(place.state_dir, self._costs_key(place))
            if kept is not None:
                picker.seed_history(*kept)
        self._acceptance_kept = picker.kept_history()  # what is on disk, or nothing yet
        self.runner.depth_picker = picker
        if isinstance(adapter, SupportsAdaptiveVerification):
            adapter.follow(picker)  # a DSpark head's confidences (`engine.spec.dspark`)
        self.runner.clock = clock
        self.runner.forget_last_step()
        return picker

    def _keep_acceptance(self) -> None:
        """Write the depth picker's acceptance counts for later runs (`cost_store`):
        after the first request with an automatic depth, then at most every
        KEEP_ACCEPTANCE_EVERY_S; before the request's finish is sent, so a `generate`
        that exits on it has written them. Not a warm-up's (a fixed prompt), nor a
        follower's (rank 0 keeps the group's)."""
        place = self.config.round_costs
        picker = self.depth_picker
        if place is None or picker is None or self.warming_up or self.follows_group:
            return
        now = time.monotonic()
        last = self._acceptance_kept_at
        if last is not None and now - last < KEEP_ACCEPTANCE_EVERY_S:
            return
        counts = picker.kept_history()
        if counts == self._acceptance_kept:
            return  # nothing drafted since: no write at the end of a plain request
        self._acceptance_kept_at, self._acceptance_kept = now, counts
        save_acceptance(place.state_dir, self._costs_key(place), *counts)

    def _costs_key(self, place: CostsPlace) -> CostsKey:
        clock = getattr(cost_clock(), "__name__", "wall")
        return place.key(dataclasses.asdict(self.config.tuning), self.depth, clock)

    def _stored_costs(self) -> RoundCosts | None:
        """What the calibration about to run may start from instead of measuring: on a
        follower rank what rank 0 sent, else the costs kept by an earlier run. Rank 0
        sends its own to the followers with the step (`lockstep`), so either every rank
        measures in that step or none does."""
        if self.leader_costs is not None:
            return self.leader_costs
        if self._looked_for_stored and self._on_its_own():
            return None  # `_depth_for` looked when it planned the step: none was kept
        place = self.config.round_costs
        stored = None if place is None else load_costs(place.state_dir, self._costs_key(place))
        if self.lockstep is not None:
            self.lockstep.send_round_costs(stored)
        return stored

    def _on_its_own(self) -> bool:
        """One process, not a rank of a tensor-parallel group."""
        return self.lockstep is None and not self.follows_group and self.leader_costs is None

    def _count_progress(self) -> None:
        """Work inside a long step (the depth calibration) that watchdogs count as progress."""
        self.progress += 1

    def _depth_for(self, sequence: RequestState) -> int:
        """Drafts for the sequence's next round: its fixed depth, or the depth picker's pick
        (before the first calibration, `FIRST_DEPTH`)."""
        if not sequence.auto:
            return sequence.depth
        if self.depth_picker is None and not self._looked_for_stored and self._on_its_own():
            # A calibration an earlier run kept picks this first round too (not the
            # blind `FIRST_DEPTH`, a wasted round where drafting does not pay). Ranks
            # of a group read it in the step instead (`_stored_costs`).
            stored = self._stored_costs()
            self._looked_for_stored = True
            if stored is not None:
                try:  # planning, outside a step: a failure must not end the engine
                    self.depth_picker = self._calibrate(stored)
                except Exception:
                    log.exception("kept round costs unusable; the first round measures them")
        if self.depth_picker is None:
            return min(FIRST_DEPTH, sequence.depth)
        pick = self.depth_picker.pick(
            sequence.stats,
            sequence.plain_streak,
            sequence.chosen_depth,
            probes=sequence.probes,
            remaining=sequence.budget,
        )
        if pick.chosen > 0:
            sequence.probes = 0
        elif pick.far_probe:
            sequence.probes += 1
        sequence.chosen_depth = pick.chosen
        return min(pick.depth, sequence.depth)

    def _run(self, step: Step) -> None:
        sequences = [s for rid in step.request_ids if (s := self.scheduler.find(rid))]
        self.current_step = step
        self.step_started_at = time.monotonic()
        calibration_s = 0.0
        calibrating = (
            self.depth_picker is None
            and step.kind == "speculate"
            and any(s.auto for s in sequences)
        )
        try:
            # Before the broadcast: rank 0 sends the costs it will start from with it.
            stored = self._stored_costs() if calibrating else None
            if self.lockstep is not None:
                # Inside the step, so a follower that never answers is a stalled step
                # for the watchdog, like a forward whose all_sum never completes.
                self.lockstep.publish(step, self.warming_up)
            if self.before_step is not None:
                self.before_step(step)
            if calibrating:
                began = time.monotonic()
                try:
                    self.depth_picker = self._calibrate(stored)
                finally:  # a calibration that fails is not a step's time either
                    calibration_s = time.monotonic() - began
            emitted = self.runner.run(step, sequences)
        except Exception as exc:  # a failed step fails its requests, not the engine
            log.exception("step %d (%s) failed", step.index, step.kind)
            if self.lockstep is not None or self.follows_group:
                # In a group a whole step that raised is the group's failure (a lost
                # peer, a collective), not these requests': the loop ends the process,
                # and the front resumes them elsewhere and restarts the group. A
                # follower that went on would wait for rank 0's next step on a broken
                # group, outside any step, where no watchdog sees it.
                raise
            for sequence in sequences:
                self._finish(sequence, "error", error=f"{type(exc).__name__}: {exc}")
            emitted = {}
        finally:
            # Not the calibration: it runs once, counts as progress as it goes, and
            # takes ~100 plain steps (1 s on a CPU); as a speculative step's time it
            # made the p99 that and the front's hang limit (20 x p99) 20 s, not 3 s.
            seconds = time.monotonic() - self.step_started_at - calibration_s
            self.step_times.record(step, seconds)
            self.current_step = None
            self.progress += 1
        for sequence in sequences:  # a request whose own token choice failed fails alone
            error = self.runner.failed.get(sequence.request_id)
            if error is not None:
                self._finish(sequence, "error", error=error)
        for sequence in sequences:
            tokens = emitted.get(sequence.request_id)
            if tokens and sequence.phase is not Phase.FINISHED:
                self._emit(sequence, tokens)
        self.scheduler.remove_finished()
        self.runner.settle()

    def _emit(self, sequence: RequestState, tokens: list[int]) -> None:
        stop_ids = sequence.request.params.stop_token_ids
        kept: list[int] = []
        reason: FinishReason | None = None
        for token in tokens:
            if token in stop_ids:
                reason = "stop"
                break
            kept.append(token)
            if len(sequence.generated) + len(kept) >= sequence.request.params.max_tokens:
                reason = "length"
                break
        sequence.generated.extend(kept)
        chooser = sequence.chooser
        if chooser is not None and chooser.finished and len(kept) == len(tokens):
            # The grammar is complete (on the budget's last token too): nothing may follow.
            reason = "stop"
        if kept:
            logprobs = chooser.take_logprobs(len(tokens)) if chooser is not None else None
            if logprobs is not None:
                logprobs = logprobs[: len(kept)]
            event = TokensEvent(sequence.request_id, tuple(kept), logprobs)
            self._streams[sequence.request_id].put(event)
        if reason is not None:
            self._finish(sequence, reason)

    def _finish(
        self, sequence: RequestState, reason: FinishReason, error: str | None = None
    ) -> None:
        if sequence.phase is Phase.FINISHED:
            return
        sequence.phase = Phase.FINISHED
        sequence.finish_reason = reason
        cache_bytes = self.runner.release(sequence)
        sequence.pending = None
        sequence.state = None
        usage = Usage(
            prompt_tokens=len(sequence.prompt),
            completion_tokens=len(sequence.generated),
            cached_tokens=sequence.cached_tokens,
        )
        speculative = sequence.stats.as_dict() if sequence.depth > 0 else None
        stream = self._streams.pop(sequence.request_id)
        busy_peak = int(mx.get_peak_memory())
        memory = {
            "active_bytes": int(mx.get_active_memory()),
            "peak_bytes": max(self._serving_peak, busy_peak),
            "busy_peak_bytes": busy_peak,
            "weights_bytes": self._weights_bytes,
            "cache_bytes": cache_bytes,
            "prefix_cache_bytes": self.prefix_cache.nbytes if self.prefix_cache else 0,
        }
        self.mirrored.pop(sequence.request_id, None)  # a follower keeps nothing finished
        if sequence.auto:
            self._keep_acceptance()
        stream.put(FinishEvent(sequence.request_id, reason, usage, speculative, error, memory))
