"""The automatic speculative depth: per request, the depth with the most tokens per second.

A round at depth k emits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k tokens on
average, where a_j is the chance that draft j is kept once drafts 1 .. j-1 were (the
request's running acceptance per draft position), and costs round(k) seconds (the
engine's measured cost of a whole round at depth k; round(0) is a plain step).
`choose_depth` picks the k maximising E(k) / round(k), 0 when no depth beats plain
decoding.

Estimates start from a prior (what earlier requests on this engine accepted; for a
position no request reached yet, the position before it, discounted) and move to the
request's own counts. A request decoding plainly probes depth 1 now and then (often
while depth 1 is estimated near break-even, less and less often while it is far
below), so an acceptance that rises is noticed. One that speculates drafts one
deeper now and then, but only while that position's acceptance or that depth's
round time is still unknown, and only if the estimate puts it near the chosen
depth: once measured, or estimated far worse, exploring would only cost rounds at
a depth judged worse.
Round costs start from a calibration (`costs.measure_round_costs`), its
probes interleaved so they compare like with like, and on a GPU follow the round
times the engine observes (recent ones: a depth not timed for a while is priced by
the calibration again, `STALE_AFTER`); timed by `mlxserve.hardware.clock` (CPU time on a CPU
device, where the wall clock counts other processes' turns and made the choice
chase noise; there observed times only scale the calibration, see that module).
"""

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from mlxserve.engine.core.request import SpeculativeStats
from mlxserve.engine.spec.costs import RoundCosts

#: Acceptance assumed for a draft position nothing is known about yet.
NEUTRAL_ACCEPTANCE = 0.6
#: A position no request has reached yet: the acceptance of the one before, times this
#: (a draft further ahead is kept less often; an optimistic guess explored deep depths).
UNSEEN_DISCOUNT = 0.85
#: Weight of the prior, in rounds, against the request's own counts. Heavy: a reply's
#: first tokens are the hardest to draft (the demo's first two depth-1 rounds were
#: rejected on every request, at 0.85 acceptance after), and with a weight of 4
#: those two rounds turned speculation off for the rest of the request.
PRIOR_ROUNDS = 16.0
#: Weight, in rounds, of the neutral (or discounted) guess against the engine's history
#: in the prior: light, the history is evidence from this model and machine.
GUESS_ROUNDS = 4.0
#: A request decoding plainly tries depth 1 after this many plain steps.
PROBE_EVERY = 32
#: ...or after this many, while depth 1 is estimated within PROBE_NEAR_WITHIN of plain
#: decoding's rate. Near break-even the estimate decides on little: a calibration a few
#: percent off, an acceptance that is still mostly the prior. And rare probes land on
#: the same positions of a reply each time (greedy decoding repeats itself): on the demo
#: a prompt whose first draft is kept 80% of the time probed at steps 32 and 64, was
#: rejected there, and decoded plainly at 0.68x of depth 3. A probe costs little where
#: it is near break-even, by definition.
PROBE_NEAR_EVERY = 8
PROBE_NEAR_WITHIN = 0.85
#: Each far probe that leaves a request plain doubles the wait before its next far one, up
#: to PROBE_EVERY << MAX_PROBE_BACKOFF steps (256). A probe costs more than its round:
#: on the H200 it drains the pipeline and the plain step after it starts it again,
#: about one plain step more than its tokens (`benchmarks/plain_paths.py`: probes
#: 9-12 ms and the steps after them 8-12 ms, against 4-5 ms plain steps), so demo
#: prompts whose drafts did not pay, probing every 32 steps, ran 1-6 % below depth 0.
#: Near break-even probes stay frequent: there a probe may well turn drafting on.
MAX_PROBE_BACKOFF = 3
#: A request decoding plainly does not probe with fewer tokens than this left to emit
#: (its ``max_tokens`` less those made). A probe pays only through the tokens after it:
#: near break-even, where probes are frequent, drafting gains a few percent of them,
#: under a plain step in 32 tokens, while each probe cost about 0.6 of one (the demo
#: on this CPU, stop 33: a 25-token `generate` at `auto` made two, 3 % over depth 0).
PROBE_MIN_REMAINING = 32
#: A request decoding plainly reconsiders its choice every this many plain steps (a
#: decision per step would add host work to every plain step).
RECHECK_EVERY = 8
#: Every this many rounds, a request drafts one deeper than its choice while that depth
#: is unexplored: it gets acceptance counts and measured round times instead of guesses.
EXPLORE_EVERY = 4
#: An unexplored depth is explored only if its estimated rate is within this share of
#: the chosen depth's (the estimate is optimistic for an unseen position already).
EXPLORE_WITHIN = 0.9
#: A depth counts as explored once its round time is observed and its last position
#: was reached this often (over the engine's requests), or it ran twice as many rounds
#: (a position seldom reached adds little: no need to wait for its counts).
EXPLORED_ROUNDS = 16
#: How much better (relative rate) another depth must look to replace the current.
SWITCH_MARGIN = 0.05
#: Round times kept per depth; the estimate is their median (one slow round, a page
#: fault or another process's turn, moves it not at all).
OBSERVED_WINDOW = 9
#: Observations a depth needs before its median replaces the calibrated estimate.
MIN_OBSERVED = 3
#: A depth none of whose last this many observations (steps and rounds at any depth)
#: was at it loses its window: its times came from another moment of the host. On an
#: H100 (stop 25) a request that decoded plainly for the start of its first reply and
#: drafted at depth 1 from then on kept those plain steps' times for 23 more replies:
#: 4.9-24.5 ms, median 8.65 ms, while a depth-0 engine decoded at 3.7 ms a token in the
#: same rounds. Plain decoding looked twice as dear as it was, and `auto` drafted at
#: 0.93 of depth 0. Only timed steps count (not a probe's first round, a batch's or a
#: grammar's): about two 128-token replies decoded plainly, three to five drafting.
#: Long enough that a depth in use keeps its window; one left behind is then priced
#: by the calibration again, and re-timed if it is chosen or explored.
STALE_AFTER = 256
#: The most rounds at any draft position that counts kept from earlier runs
#: (`seed_history`, `kept_history`) may weigh: they speak for this model and drafter
#: on the kinds of prompts it was given, and a run whose prompts draft otherwise moves
#: the estimate within a few dozen rounds. Kept counts are scaled down to it each
#: time they are written, so older runs fade.
KEPT_HISTORY_ROUNDS = 64
#: Depth-1 rounds of one request after which a probe no longer drafts on to get depth
#: 1 timed: the untimed first round, the first timed one (dropped) and MIN_OBSERVED.
PROBE_ROUNDS = 2 + MIN_OBSERVED


class Pick(NamedTuple):
    """What `DepthPicker.pick` decided for a request's next round."""

    #: drafts to run now (differs from ``chosen`` on a probe or an exploration)
    depth: int
    #: the depth chosen (0: decoding plainly)
    chosen: int
    #: a far probe: it spaces out the request's next far probe (``probes``)
    far_probe: bool = False


def expected_tokens(acceptance: Sequence[float], depth: int) -> float:
    """E(depth): tokens one round emits, given conditional acceptance per position."""
    total, kept = 1.0, 1.0
    for rate in acceptance[:depth]:
        kept *= rate
        total += kept
    return total


def choose_depth(
    acceptance: Sequence[float],
    costs: RoundCosts,
    batch_size: int = 1,
    max_depth: int = 5,
    current: int | None = None,
) -> int:
    """The depth with the most expected tokens per second for one request.

    ``batch_size``: how many requests a plain decode step serves at once. A batched
    step costs about one step for all of them (decoding is bound by launches and
    weight reads), while a round verifies one request: plain decoding's rate per step
    grows with the batch, so a large batch turns speculation off.

    ``current``: the depth in use; another must beat it by ``SWITCH_MARGIN``, so
    timing noise does not flip the choice back and forth.
    """
    rates = {0: max(batch_size, 1) / costs.round(0)}
    for depth in range(1, min(max_depth, len(acceptance)) + 1):
        rates[depth] = expected_tokens(acceptance, depth) / costs.round(depth)
    best = max(rates, key=lambda depth: rates[depth])
    if current in rates and rates[best] < rates[current] * (1 + SWITCH_MARGIN):
        return current
    return best


def conditional_acceptance(
    stats: SpeculativeStats, prior: Sequence[float], max_depth: int
) -> list[float]:
    """a_1 .. a_max_depth: the request's counts, shrunk towards ``prior``."""
    rates: list[float] = []
    for position in range(max_depth):
        reached = stats.reached_at_depth[position] if position < len(stats.reached_at_depth) else 0
        kept = stats.accepted_at_depth[position] if position < len(stats.accepted_at_depth) else 0
        base = prior[position] if position < len(prior) else (rates[-1] if rates else 0.0)
        rates.append((kept + PRIOR_ROUNDS * base) / (reached + PRIOR_ROUNDS))
    return rates


@dataclass
class DepthPicker:
    """The engine's side: measured costs, the acceptance of past requests, the choice
    of each round's depth (`pick`). A picker of depths, not of tokens: a request's
    tokens are chosen by its `mlxserve.engine.sample.logits.TokenChooser`."""

    max_depth: int
    calibrated: RoundCosts
    # depth -> median round time, once MIN_OBSERVED rounds were timed
    observed: dict[int, float] = field(default_factory=dict)
    history: SpeculativeStats = field(default_factory=SpeculativeStats)
    seen: set[int] = field(default_factory=set)
    samples: dict[int, deque[float]] = field(default_factory=dict)
    # Whether round times observed at different moments may be compared with each
    # other (`mlxserve.hardware.clock.observed_times_comparable`).
    follow_observed: bool = True
    # The engine's own time between two steps of a request (`observe_between`).
    between: deque[float] = field(default_factory=lambda: deque(maxlen=OBSERVED_WINDOW))
    # Observations so far (at any depth), and the count at each depth's latest one.
    ticks: int = 0
    last_tick: dict[int, int] = field(default_factory=dict)
    # A drafter with a confidence head (DSpark): per draft position, the sum and count
    # of the chances it gave (`observe_confidence`), the prior's guess where nothing
    # was verified yet.
    confidence_sum: list[float] = field(default_factory=list)
    confidence_count: list[int] = field(default_factory=list)
    # What earlier runs accepted (`seed_history`): where `history` starts, and what
    # `forget_observations` returns it to.
    seeded: SpeculativeStats = field(default_factory=SpeculativeStats)

    def costs(self) -> RoundCosts:
        """Calibrated costs, replaced by observed round times where there are some
        (with `follow_observed`); the others are scaled like the observed ones (a
        longer context, a busier machine). Without `follow_observed` every depth is
        scaled alike, so only the calibration ranks them."""
        ratios = [t / self.calibrated.round(k) for k, t in self.observed.items()]
        scale = sorted(ratios)[len(ratios) // 2] if ratios else 1.0
        observed = self.observed if self.follow_observed else {}
        overhead = self.overhead()
        plain = observed.get(0, self.calibrated.plain * scale) + overhead
        rounds = {
            k: observed.get(k, self.calibrated.round(k) * scale) + overhead
            for k in range(1, self.max_depth + 1)
        }
        # As a RoundCosts whose round(k) is the estimate: verify holds the whole round.
        return RoundCosts(plain=plain, verify=rounds, draft=0.0)

    def observe(self, depth: int, seconds: float) -> None:
        """A measured step or round. The first at each depth is dropped (kernels for
        its shapes compile on first use, on CUDA for hundreds of ms); the estimate is
        the median of the last OBSERVED_WINDOW, from MIN_OBSERVED on."""
        if depth not in self.seen:
            self.seen.add(depth)
            return
        self.ticks += 1
        self.last_tick[depth] = self.ticks
        self._expire()
        window = self.samples.setdefault(depth, deque(maxlen=OBSERVED_WINDOW))
        window.append(seconds)
        if len(window) >= MIN_OBSERVED:
            self.observed[depth] = statistics.median(window)

    def _expire(self) -> None:
        """Drop the window of every depth not observed in the last STALE_AFTER
        observations: it falls back to the calibration, scaled like the fresh ones,
        until MIN_OBSERVED new times are taken. Only with `follow_observed`: without
        it the windows rank nothing, and an expired one would only send a depth to
        be explored again (`explored`) for times that are not used."""
        if not self.follow_observed:
            return
        for depth, tick in list(self.last_tick.items()):
            if self.ticks - tick >= STALE_AFTER:
                del self.last_tick[depth]
                self.samples.pop(depth, None)
                self.observed.pop(depth, None)

    def observe_between(self, seconds: float) -> None:
        """The engine's time from the end of one step of a request to the start of its
        next: emitting the tokens, scheduling, the caller's share of the loop."""
        self.between.append(seconds)

    def overhead(self) -> float:
        """What every step pays besides its own forwards (`observe_between`), once
        MIN_OBSERVED are timed and with `follow_observed`; 0 before.

        Step and round times are taken inside the runner, so without this a round
        looked dearer against a plain step than it is: both pay this once. A plain
        step overlaps it with the device (the next step is queued before the engine
        returns) and a round does not, but either way a step's share of the wall
        clock is its runner time plus this.
        """
        if not self.follow_observed or len(self.between) < MIN_OBSERVED:
            return 0.0
        return statistics.median(self.between)

    def forget_observations(self) -> None:
        """Drop the acceptance and round times seen so far (a warm-up's: a fixed
        prompt, timed while compiling), keeping the calibration and which depths have
        run once (their first round, the one that compiles, stays dropped)."""
        self.history = _copy_counts(self.seeded)
        self.samples.clear()
        self.observed.clear()
        self.between.clear()
        self.last_tick.clear()

    def seed_history(self, reached: Sequence[int], accepted: Sequence[int]) -> None:
        """Start from the counts an earlier run kept (`kept_history`), scaled down to
        KEPT_HISTORY_ROUNDS, in place of the neutral guess alone."""
        self.seeded = SpeculativeStats()
        reached_, accepted_ = _capped(reached, accepted)
        self.seeded.reached_at_depth = reached_
        self.seeded.accepted_at_depth = accepted_
        self.seeded.drafted_at_depth = list(reached_)
        self.history = _copy_counts(self.seeded)

    def kept_history(self) -> tuple[list[int], list[int]]:
        """(reached, accepted) per draft position, for a later run (`seed_history`)."""
        return _capped(self.history.reached_at_depth, self.history.accepted_at_depth)

    def observe_confidence(self, values: Sequence[float]) -> None:
        """A round's confidences, per draft position (the drafter's own estimate of the
        chance each draft is kept)."""
        for position, value in enumerate(values):
            if position == len(self.confidence_sum):
                self.confidence_sum.append(0.0)
                self.confidence_count.append(0)
            self.confidence_sum[position] += value
            self.confidence_count[position] += 1

    def confidence(self, position: int) -> float | None:
        """The mean confidence at ``position`` (None: no drafter reported one)."""
        if position >= len(self.confidence_count) or not self.confidence_count[position]:
            return None
        return self.confidence_sum[position] / self.confidence_count[position]

    def prior(self) -> list[float]:
        """Acceptance per position over the requests this engine has served so far.
        Where its drafter has a confidence head, the guess behind the counts is the
        mean confidence there (a verified count still outweighs it)."""
        rates: list[float] = []
        for position in range(self.max_depth):
            previous = rates[-1] * UNSEEN_DISCOUNT if rates else NEUTRAL_ACCEPTANCE
            confident = self.confidence(position)
            if confident is not None:
                previous = confident
            reached = self._at(self.history.reached_at_depth, position)
            kept = self._at(self.history.accepted_at_depth, position)
            rates.append((kept + GUESS_ROUNDS * previous) / (reached + GUESS_ROUNDS))
        return rates

    def explored(self, depth: int) -> bool:
        """Whether `depth`'s last draft position and round time are measured."""
        reached = self._at(self.history.reached_at_depth, depth - 1)
        rounds = self.history.steps_at_depth.get(depth, 0)
        known = reached >= EXPLORED_ROUNDS or rounds >= 2 * EXPLORED_ROUNDS
        return known and depth in self.observed

    def choose(self, stats: SpeculativeStats, plain_streak: int, batch_size: int = 1) -> int:
        return self.pick(stats, plain_streak, None, batch_size)[0]

    def pick(
        self,
        stats: SpeculativeStats,
        plain_streak: int,
        current: int | None,
        batch_size: int = 1,
        probes: int = 0,
        remaining: int | None = None,
    ) -> Pick:
        """The depth to run now and the depth chosen: they differ on a probe or an
        exploration. ``probes``: the far probes the request made since it last chose
        to draft (each left it decoding plainly), which space out its next far probe;
        ``remaining``: the tokens it may still emit (None: unbounded)."""
        if current == 0 and plain_streak % RECHECK_EVERY:
            return Pick(0, 0)
        acceptance = conditional_acceptance(stats, self.prior(), self.max_depth)
        costs = self.costs()
        depth = choose_depth(acceptance, costs, batch_size, self.max_depth, current)
        if depth == 0:
            if self._probe_goes_on(stats, plain_streak, current):
                return Pick(1, 0)
            plain_rate = max(batch_size, 1) / costs.round(0)
            near = expected_tokens(acceptance, 1) / costs.round(1) >= PROBE_NEAR_WITHIN * plain_rate
            every = PROBE_NEAR_EVERY if near else PROBE_EVERY << min(probes, MAX_PROBE_BACKOFF)
            worth = remaining is None or remaining >= PROBE_MIN_REMAINING
            probe = plain_streak >= every and worth
            return Pick(1 if probe else 0, 0, far_probe=probe and not near)
        rounds = sum(n for k, n in stats.steps_at_depth.items() if k > 0)
        deeper = depth + 1
        if (
            deeper <= self.max_depth
            and rounds % EXPLORE_EVERY == EXPLORE_EVERY - 1
            and not self.explored(deeper)
            and self._promising(acceptance, costs, depth, deeper)
        ):
            return Pick(deeper, depth)
        return Pick(depth, depth)

    def _probe_goes_on(
        self, stats: SpeculativeStats, plain_streak: int, current: int | None
    ) -> bool:
        """Whether a request that just probed depth 1 from plain decoding drafts once
        more: while depth 1's round time is not yet observed (`follow_observed`). A probe
        round is never timed (it also folds the plain steps' MTP entries in), so without
        this a request that decodes plainly never measures depth 1: the calibration
        alone keeps it plain (on the H200 a demo prompt whose first draft was kept 85 %
        of the time decoded plainly at 0.85x of depth 0 and 0.73x of depth 2)."""
        probed = plain_streak == 0 and any(n for k, n in stats.steps_at_depth.items() if k > 0)
        # At most PROBE_ROUNDS of a request's rounds: some are never timed (a grammar's,
        # a batch's), and those must not keep a request drafting on.
        few = stats.steps_at_depth.get(1, 0) < PROBE_ROUNDS
        return current == 0 and probed and few and self.follow_observed and 1 not in self.observed

    @staticmethod
    def _promising(acceptance: Sequence[float], costs: RoundCosts, depth: int, other: int) -> bool:
        """Whether `other` is estimated within EXPLORE_WITHIN of `depth`'s rate: one
        estimated far worse is not worth rounds to measure."""
        rate = expected_tokens(acceptance, depth) / costs.round(depth)
        return expected_tokens(acceptance, other) / costs.round(other) >= EXPLORE_WITHIN * rate

    def record(self, drafted: int, accepted: int) -> None:
        self.history.record(drafted, accepted)

    @staticmethod
    def _at(counts: list[int], position: int) -> int:
        return counts[position] if position < len(counts) else 0


def _capped(reached: Sequence[int], accepted: Sequence[int]) -> tuple[list[int], list[int]]:
    """The counts scaled so that no position weighs more than KEPT_HISTORY_ROUNDS
    rounds, each position's rate kept (up to rounding)."""
    most = max(reached, default=0)
    scale = min(1.0, KEPT_HISTORY_ROUNDS / most) if most else 1.0
    reached_ = [round(r * scale) for r in reached]
    accepted_ = [min(round(a * scale), r) for a, r in zip(accepted, reached_, strict=True)]
    return reached_, accepted_


def _copy_counts(stats: SpeculativeStats) -> SpeculativeStats:
    copy = SpeculativeStats()
    copy.reached_at_depth = list(stats.reached_at_depth)
    copy.accepted_at_depth = list(stats.accepted_at_depth)
    copy.drafted_at_depth = list(stats.drafted_at_depth)
    return copy
