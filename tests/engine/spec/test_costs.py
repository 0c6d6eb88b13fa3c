"""Round costs: whole rounds measured on a real model, parts as the fallback."""

from mlxserve.engine.spec.costs import RoundCosts, measure_round_costs
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.v4_models import tiny_v4


def test_a_measured_round_wins_over_its_parts() -> None:
    costs = RoundCosts(plain=1.0, verify={1: 1.2, 2: 1.4}, draft=0.3, rounds={1: 2.0})
    assert costs.round(0) == 1.0
    assert costs.round(1) == 2.0  # measured
    assert costs.parts(1) == 1.5
    assert costs.round(2) == 2.0  # parts: 1.4 + 2 x 0.3


def test_the_engine_calibration_times_whole_rounds() -> None:
    """On a real (tiny) DeepSeek-V4 with MTP: every depth's round is timed, on copies
    of the throw-away state, and nothing of that state leaks into the next probe."""
    ticks: list[int] = []
    adapter = MTPAdapter(tiny_v4())
    costs = measure_round_costs(
        adapter, trials=1, steps=2, context=12, tick=lambda: ticks.append(1), parts=False
    )
    depth = adapter.max_draft_depth
    assert sorted(costs.rounds) == list(range(1, depth + 1))
    assert all(seconds > 0 for seconds in costs.rounds.values()) and costs.plain > 0
    assert costs.verify == {} and costs.draft == 0.0
    assert len(ticks) == 2 * (1 + depth)  # an untimed pass and one trial, every probe
