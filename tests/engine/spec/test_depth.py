"""The automatic speculative depth: the choice follows acceptance and costs."""

import pytest

from mlxserve.engine.core.request import SpeculativeStats
from mlxserve.engine.spec.costs import RoundCosts
from mlxserve.engine.spec.depth import (
    EXPLORE_EVERY,
    EXPLORED_ROUNDS,
    KEPT_HISTORY_ROUNDS,
    MAX_PROBE_BACKOFF,
    MIN_OBSERVED,
    PROBE_EVERY,
    PROBE_MIN_REMAINING,
    PROBE_NEAR_EVERY,
    PROBE_ROUNDS,
    RECHECK_EVERY,
    STALE_AFTER,
    UNSEEN_DISCOUNT,
    DepthPicker,
    choose_depth,
    conditional_acceptance,
    expected_tokens,
)

# A GPU-like round: verifying k + 1 tokens costs about one step, a draft 1/40 of one.
CHEAP_VERIFY = RoundCosts(plain=1.0, verify={k: 1.0 + 0.02 * k for k in range(1, 6)}, draft=0.025)
# A CPU-like round: verify grows with k, a draft costs a third of a step (3-layer demo).
DEAR_VERIFY = RoundCosts(plain=1.0, verify={k: 1.0 + 0.3 * k for k in range(1, 6)}, draft=0.33)
# Measured whole rounds where depth 2 comes close to depth 1 at middling acceptance.
CLOSE = RoundCosts(plain=1.0, rounds={1: 1.5, 2: 1.9, 3: 2.6, 4: 3.3, 5: 4.0})


def test_expected_tokens() -> None:
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1.875)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def test_high_acceptance_and_cheap_verify_draft_deep() -> None:
    assert choose_depth([0.85] * 5, CHEAP_VERIFY) >= 4


def test_speculation_that_does_not_pay_picks_zero() -> None:
    assert choose_depth([0.2] * 5, DEAR_VERIFY) == 0
    assert choose_depth([0.02] * 5, CHEAP_VERIFY) == 0


def test_dear_verify_drafts_shallow() -> None:
    assert choose_depth([0.7, 0.6, 0.5, 0.4, 0.3], DEAR_VERIFY) == 1


def test_a_close_call_keeps_the_current_depth() -> None:
    acceptance = [0.7, 0.6, 0.5, 0.4, 0.3]
    best = choose_depth(acceptance, CHEAP_VERIFY)
    rates = {k: expected_tokens(acceptance, k) / CHEAP_VERIFY.round(k) for k in range(6)}
    close = [k for k in range(6) if k != best and rates[k] * 1.05 > rates[best]]
    assert close  # a depth within the margin of the best
    assert choose_depth(acceptance, CHEAP_VERIFY, current=close[0]) == close[0]
    assert choose_depth(acceptance, CHEAP_VERIFY, current=0) == best  # far from it


def test_a_large_batch_turns_speculation_off() -> None:
    assert choose_depth([0.85] * 5, CHEAP_VERIFY, batch_size=1) > 0
    assert choose_depth([0.85] * 5, CHEAP_VERIFY, batch_size=8) == 0


def test_conditional_acceptance_moves_from_the_prior_to_the_counts() -> None:
    stats = SpeculativeStats()
    assert conditional_acceptance(stats, [0.6] * 3, 3) == pytest.approx([0.6] * 3)
    for _ in range(1000):
        stats.record(2, 1)  # the first draft always kept, the second never
    first, second, third = conditional_acceptance(stats, [0.6] * 3, 3)
    assert first > 0.97 and second < 0.03
    assert third == pytest.approx(0.6)  # never drafted: the prior


def test_picker_follows_observed_costs_and_probes() -> None:
    picker = DepthPicker(max_depth=5, calibrated=CHEAP_VERIFY)
    good = SpeculativeStats()
    for _ in range(50):
        good.record(3, 3)
    assert picker.choose(good, plain_streak=0) >= 3
    bad = SpeculativeStats()
    for _ in range(200):
        bad.record(1, 0)
    assert picker.choose(bad, plain_streak=0) == 0
    assert picker.choose(bad, plain_streak=PROBE_EVERY) == 1
    # Rounds observed to be far dearer than plain steps: plain decoding wins. The
    # first time at each depth is dropped (it includes compiling kernels), and an
    # observed time counts from MIN_OBSERVED on.
    for _ in range(1 + MIN_OBSERVED):
        picker.observe(0, 1.0)
        for depth in range(1, 6):
            picker.observe(depth, 50.0)
    assert picker.choose(good, plain_streak=0) == 0


def test_every_few_rounds_an_unexplored_depth_is_tried() -> None:
    picker = DepthPicker(max_depth=5, calibrated=CLOSE)
    stats = SpeculativeStats()
    for kept in (1, 1, 0, 1, 1, 0, 1, 1, 0, 1)[: EXPLORE_EVERY - 2]:
        stats.record(1, kept)
    assert picker.choose(stats, plain_streak=0) == 1
    stats.record(1, 1)  # the EXPLORE_EVERY-th round comes next
    assert picker.choose(stats, plain_streak=0) == 2


def test_observed_round_times_are_a_median_that_ignores_an_outlier() -> None:
    picker = DepthPicker(max_depth=5, calibrated=CHEAP_VERIFY)
    picker.observe(2, 99.0)  # first: dropped
    picker.observe(2, 1.0)
    picker.observe(2, 1000.0)
    assert 2 not in picker.observed  # too few to replace the calibration
    picker.observe(2, 1.2)
    assert picker.observed[2] == pytest.approx(1.2)
    assert picker.costs().round(2) == pytest.approx(1.2)


def test_a_depth_left_behind_loses_its_stale_window() -> None:
    """Plain steps timed in a slow spell at a reply's start, then only depth-1 rounds:
    the plain steps' window expires after STALE_AFTER observations and plain decoding
    is priced by the calibration, scaled like the fresh rounds (on an H100 the stale
    window priced it at twice its cost and kept a request drafting at a loss)."""
    picker = DepthPicker(max_depth=1, calibrated=RoundCosts(plain=1.0, rounds={1: 1.7}))
    stats = SpeculativeStats()
    for i in range(100):
        stats.record(1, 1 if i % 5 < 3 else 0)  # E(1) about 1.6: 0.94 of plain at 1.7 steps
    for _ in range(1 + MIN_OBSERVED):
        picker.observe(0, 2.5)
        picker.observe(1, 1.7)
    assert picker.choose(stats, plain_streak=0) == 1  # plain looks 2.5 steps dear
    for _ in range(STALE_AFTER - 2):  # with the round after it: STALE_AFTER - 1 since
        picker.observe(1, 1.7)
    assert picker.observed[0] == pytest.approx(2.5)  # not stale yet
    picker.observe(1, 1.7)
    assert 0 not in picker.observed and 0 not in picker.samples
    assert picker.observed[1] == pytest.approx(1.7)  # the depth in use keeps its window
    assert picker.costs().round(0) == pytest.approx(1.0)
    assert picker.choose(stats, plain_streak=0) == 0
    # Timed again, plain decoding counts from MIN_OBSERVED new times (none dropped).
    for _ in range(MIN_OBSERVED):
        picker.observe(0, 1.1)
    assert picker.observed[0] == pytest.approx(1.1)
    # Without following observed times (a CPU's) windows rank nothing and stay.
    cpu = DepthPicker(max_depth=1, calibrated=picker.calibrated, follow_observed=False)
    for _ in range(1 + MIN_OBSERVED):
        cpu.observe(0, 2.5)
    for _ in range(2 * STALE_AFTER):
        cpu.observe(1, 1.7)
    assert cpu.observed[0] == pytest.approx(2.5)


def test_an_explored_depth_is_not_explored_again() -> None:
    picker = DepthPicker(max_depth=5, calibrated=CLOSE)
    stats = SpeculativeStats()
    for kept in (1, 1, 0, 1, 1, 0, 1)[: EXPLORE_EVERY - 1]:
        stats.record(1, kept)
    assert picker.pick(stats, 0, 1)[:2] == (2, 1)  # depth 2 unknown: this round explores it
    for _ in range(EXPLORED_ROUNDS):
        picker.record(2, 1)  # position 2 reached often enough, and never kept
    for _ in range(1 + MIN_OBSERVED):  # the first observation is dropped
        picker.observe(2, CLOSE.round(2))
    assert picker.explored(2)
    assert picker.pick(stats, 0, 1)[:2] == (1, 1)


def test_an_unseen_position_is_discounted_from_the_one_before() -> None:
    picker = DepthPicker(max_depth=3, calibrated=CHEAP_VERIFY)
    for _ in range(1000):
        picker.record(1, 1)  # the first draft always kept; the second never drafted
    first, second, third = picker.prior()
    assert first > 0.99
    assert second == pytest.approx(first * UNSEEN_DISCOUNT)
    assert third == pytest.approx(second * UNSEEN_DISCOUNT)


def test_a_plain_request_reconsiders_only_every_few_steps() -> None:
    picker = DepthPicker(max_depth=5, calibrated=CHEAP_VERIFY)
    good = SpeculativeStats()
    for _ in range(50):
        good.record(3, 3)
    # Between rechecks the depth stays 0 without any estimate computed...
    assert picker.pick(good, plain_streak=RECHECK_EVERY + 1, current=0)[:2] == (0, 0)
    # ...and at a recheck the acceptance counts win.
    assert picker.pick(good, plain_streak=RECHECK_EVERY, current=0)[1] >= 3


def test_a_depth_estimated_far_worse_is_not_explored() -> None:
    # Dear drafts and a first draft seldom kept: depth 2 is far behind depth 1.
    costs = RoundCosts(plain=1.0, rounds={1: 1.05, 2: 2.5, 3: 4.0, 4: 5.5, 5: 7.0})
    picker = DepthPicker(max_depth=5, calibrated=costs)
    stats = SpeculativeStats()
    for kept in (1, 0, 1, 1, 0, 1, 1)[: EXPLORE_EVERY - 1]:
        stats.record(1, kept)
    assert picker.pick(stats, 0, 1)[:2] == (1, 1)  # an exploration round, but not worth it


def test_the_engines_time_between_steps_is_added_to_every_step() -> None:
    # A round of two plain steps keeping 0.9 of its drafts: 1.9 tokens for 2 steps
    # loses to plain decoding, until both also pay the engine's half step between steps.
    dear = RoundCosts(plain=1.0, rounds={1: 2.0})
    stats = SpeculativeStats()
    for _ in range(100):
        stats.record(1, 1 if _ % 10 else 0)
    picker = DepthPicker(max_depth=1, calibrated=dear)
    assert picker.choose(stats, plain_streak=0) == 0
    for _ in range(MIN_OBSERVED - 1):
        picker.observe_between(0.5)
    assert picker.overhead() == 0.0  # too few to count
    picker.observe_between(0.5)
    assert picker.overhead() == pytest.approx(0.5)
    assert picker.costs().round(0) == pytest.approx(1.5)
    assert picker.costs().round(1) == pytest.approx(2.5)
    assert picker.choose(stats, plain_streak=0) == 1
    picker.forget_observations()
    assert picker.overhead() == 0.0
    # Without following observed times (a CPU's), the calibration alone ranks depths.
    unfollowed = DepthPicker(max_depth=1, calibrated=dear, follow_observed=False)
    for _ in range(MIN_OBSERVED):
        unfollowed.observe_between(0.5)
    assert unfollowed.overhead() == 0.0


def test_without_following_observed_times_only_the_calibration_ranks_depths() -> None:
    good = SpeculativeStats()
    for _ in range(50):
        good.record(3, 3)
    picker = DepthPicker(max_depth=5, calibrated=CHEAP_VERIFY, follow_observed=False)
    for _ in range(1 + MIN_OBSERVED):  # rounds timed in a busy spell, plain steps in a quiet one
        picker.observe(0, 1.0)
        for depth in range(1, 6):
            picker.observe(depth, 50.0)
    costs = picker.costs()
    assert costs.round(3) / costs.round(0) == pytest.approx(CHEAP_VERIFY.round(3))
    assert picker.choose(good, plain_streak=0) >= 3


def test_a_hard_start_does_not_turn_speculation_off() -> None:
    """The engine's requests kept most first drafts; this one's first two were
    rejected (a reply's opening tokens are the hardest to draft): it keeps drafting."""
    picker = DepthPicker(max_depth=5, calibrated=CLOSE)
    for _ in range(100):
        picker.record(1, 1 if _ % 7 else 0)  # about 0.86 kept
    start = SpeculativeStats()
    start.record(1, 0)
    start.record(1, 0)
    assert picker.pick(start, 0, 1)[1] >= 1


def test_a_plain_request_near_break_even_probes_often() -> None:
    """Depth 1 estimated just below plain decoding: probes every PROBE_NEAR_EVERY
    plain steps (rare probes sampled the same positions of a greedy reply); far
    below it, only every PROBE_EVERY."""
    near, middling = _near_break_even()  # round(1) = 1.5 plain steps, E(1) = 1.5
    assert near.pick(middling, plain_streak=0, current=0)[:2] == (0, 0)
    assert near.pick(middling, plain_streak=PROBE_NEAR_EVERY, current=0)[:2] == (1, 0)
    far = DepthPicker(max_depth=5, calibrated=DEAR_VERIFY)
    rejected = SpeculativeStats()
    for _ in range(200):
        rejected.record(1, 0)
    assert far.pick(rejected, plain_streak=PROBE_NEAR_EVERY, current=0)[:2] == (0, 0)
    assert far.pick(rejected, plain_streak=PROBE_EVERY, current=0)[:2] == (1, 0)


def test_far_probes_that_leave_a_request_plain_space_out() -> None:
    """Each far probe that kept the request plain doubles the wait for the next one,
    up to MAX_PROBE_BACKOFF doublings; near break-even probes do not back off."""
    far = DepthPicker(max_depth=5, calibrated=DEAR_VERIFY)
    rejected = SpeculativeStats()
    for _ in range(200):
        rejected.record(1, 0)
    for probes in range(MAX_PROBE_BACKOFF + 3):
        wait = PROBE_EVERY << min(probes, MAX_PROBE_BACKOFF)
        before = far.pick(rejected, plain_streak=wait - RECHECK_EVERY, current=0, probes=probes)
        assert before == (0, 0, False)
        assert far.pick(rejected, plain_streak=wait, current=0, probes=probes) == (1, 0, True)
    near, middling = _near_break_even()
    # A near probe: not a far one, so it does not add to the back-off.
    assert near.pick(middling, plain_streak=PROBE_NEAR_EVERY, current=0, probes=9) == (1, 0, False)


def test_a_probe_from_plain_decoding_goes_on_until_depth_1_is_timed() -> None:
    """The round a probe runs is never timed (it folds the plain steps in): the probe
    drafts on until depth 1's round time is observed, so observed times can overrule
    a calibration that priced depth 1 out; once observed, a probe is one round."""
    picker = DepthPicker(max_depth=5, calibrated=CLOSE)
    for kept in (1, 0) * 20:
        picker.record(1, kept)  # earlier requests: a first draft kept half the time
    middling = SpeculativeStats()
    middling.record(1, 1)  # this request's one probe round
    assert picker.pick(middling, plain_streak=PROBE_NEAR_EVERY, current=0)[:2] == (1, 0)
    assert picker.pick(middling, plain_streak=0, current=0)[:2] == (1, 0)  # just probed
    unpromising = DepthPicker(max_depth=5, calibrated=CLOSE)
    for _ in range(40):
        unpromising.record(1, 0)  # earlier requests' first drafts all rejected
    # A request that has not probed yet (no rounds) does not start with one.
    assert unpromising.pick(SpeculativeStats(), plain_streak=0, current=0)[:2] == (0, 0)
    for _ in range(1 + MIN_OBSERVED):
        picker.observe(0, 1.0)
        picker.observe(1, 0.9)  # cheaper than calibrated: depth 1 now pays
    assert picker.pick(middling, plain_streak=0, current=0)[:2] == (1, 1)
    # A request whose rounds are never timed (a grammar's) stops after PROBE_ROUNDS.
    untimed = DepthPicker(max_depth=5, calibrated=CLOSE)
    long_probe = SpeculativeStats()
    for _ in range(PROBE_ROUNDS):
        long_probe.record(1, 1)
    for _ in range(40):
        untimed.record(1, 0)
    assert untimed.pick(long_probe, plain_streak=0, current=0)[:2] == (0, 0)
    # Without following observed times (a CPU), a probe stays one round.
    cpu = DepthPicker(max_depth=5, calibrated=CLOSE, follow_observed=False)
    for kept in (1, 0) * 20:
        cpu.record(1, kept)
    assert cpu.pick(middling, plain_streak=0, current=0)[:2] == (0, 0)


def test_a_request_with_few_tokens_left_does_not_probe() -> None:
    """Near break-even a plain request probes every PROBE_NEAR_EVERY steps, but not
    with fewer than PROBE_MIN_REMAINING tokens left to emit: the probe would cost
    more than drafting could win back in them."""
    near, middling = _near_break_even()
    due = {"plain_streak": PROBE_NEAR_EVERY, "current": 0}
    assert near.pick(middling, **due, remaining=PROBE_MIN_REMAINING)[:2] == (1, 0)  # type: ignore[arg-type]
    assert near.pick(middling, **due, remaining=PROBE_MIN_REMAINING - 1)[:2] == (0, 0)  # type: ignore[arg-type]
    assert near.pick(middling, **due)[:2] == (1, 0)  # type: ignore[arg-type]


def test_kept_acceptance_seeds_a_new_picker_scaled_down_and_survives_a_warm_up() -> None:
    """A new picker seeded with an earlier run's counts starts from their rates, not the
    neutral guess; the counts weigh at most KEPT_HISTORY_ROUNDS rounds, and forgetting
    a warm-up goes back to them, not to nothing."""
    earlier = DepthPicker(max_depth=3, calibrated=CLOSE)
    for round_ in range(400):
        earlier.record(2, 1 if round_ % 4 else 0)  # first draft kept 3/4, second never
    reached, accepted = earlier.kept_history()
    assert max(reached) == KEPT_HISTORY_ROUNDS
    assert accepted[0] / reached[0] == pytest.approx(0.75, abs=0.02) and accepted[1] == 0
    fresh = DepthPicker(max_depth=3, calibrated=CLOSE)
    guessed = fresh.prior()
    fresh.seed_history(reached, accepted)
    seeded = fresh.prior()
    assert seeded[0] == pytest.approx(0.75, abs=0.05) and seeded[1] < 0.1
    assert guessed[1] > 0.4  # the neutral guess, discounted
    fresh.record(1, 1)  # a warm-up's round
    fresh.forget_observations()
    assert fresh.prior() == seeded


def _near_break_even() -> tuple[DepthPicker, SpeculativeStats]:
    """A picker with depth 1 timed at 1.5 plain steps, and a request whose first draft
    is kept half the time (E(1) = 1.5): depth 1 estimated just below plain decoding."""
    near = DepthPicker(max_depth=5, calibrated=CLOSE)
    for _ in range(1 + MIN_OBSERVED):  # depth 1 timed: a probe is one round
        near.observe(0, 1.0)
        near.observe(1, 1.5)
    middling = SpeculativeStats()
    for kept in (1, 0) * 20:
        middling.record(1, kept)
    return near, middling
