"""DSpark rounds through the engine: greedy output is plain decoding's (alone and three
at once, planned or deciding on the round's confidences, under a chooser's penalties),
a seed gives one answer at every depth, sampled output keeps the target distribution,
and the confidence head decides how many drafts are verified: in the round, or planned
from its running confidences where the calibration says a planned round pays."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.sample.sampling import KeyStream
from mlxserve.engine.spec.costs import RoundCosts
from mlxserve.engine.spec.depth import DepthPicker
from mlxserve.engine.spec.dspark import DSparkAdapter, DSparkState
from tests.engine.drive import run
from tests.engine.spec.dspark_models import tiny_dspark

# Longer than the sliding window (8): the context keeps only its last rows.
PROMPT = tuple((7 * i + 3) % 61 for i in range(45))
PROMPTS = {"a": PROMPT, "b": PROMPT[5:30], "c": PROMPT[::2]}


class Oracle(DSparkAdapter):
    """Drafts that are the reference's greedy tokens at even draft positions and wrong at
    odd ones (the head still runs; only its token is replaced), every one verified:
    rounds keep some drafts and reject others, so trims and taps are exercised."""

    def __init__(self, model: Any, references: dict[int, list[int]]) -> None:
        super().__init__(model)
        self.references = references  # prompt length -> prompt + greedy answer
        self.at: list[int] = []
        self.verify_all = True

    def speculate(self, state: Any, last_token: int, *args: Any) -> tuple[list[int], int, int]:
        self.at = self._reference_for(state)
        return super().speculate(state, last_token, *args)

    def _reference_for(self, state: Any) -> list[int]:
        offset = int(state.offset)
        for reference in self.references.values():
            if len(reference) > offset + 1:
                return reference[offset + 1 :]
        return []

    def propose(self, level: int, logits: mx.array, params: SamplingParams, key: mx.array) -> Any:
        right = self.at[level] if level < len(self.at) else 0
        token = right if level % 2 == 0 else (right + 1) % 61
        return mx.array(token, dtype=mx.int32) + mx.argmax(logits).astype(mx.int32) * 0


class Planning(DSparkAdapter):
    """Keeps each round's plan (None: the round decided on its own confidences)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.plans: list[int | None] = []

    def _plan(self, state: DSparkState, depth: int) -> int | None:
        plan = super()._plan(state, depth)
        self.plans.append(plan)
        return plan


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_dspark()


def plain(model: Any, prompts: dict[str, tuple[int, ...]], n: int) -> dict[str, list[int]]:
    engine = Engine(DSparkAdapter(model), EngineConfig(prefill_step=16, speculative_depth=0))
    requests = [GenerationRequest(k, GenerationParams(p, n)) for k, p in prompts.items()]
    return {k: v[0] for k, v in run(engine, *requests).items()}


@pytest.mark.parametrize("depth", [1, 4])
def test_greedy_equals_plain_decoding_alone_and_three_at_once(model: Any, depth: int) -> None:
    expected = plain(model, PROMPTS, 24)
    # One prompt alone, its answer known to the oracle.
    adapter = Oracle(model, {len(PROMPT): [*PROMPT, *expected["a"]]})
    engine = Engine(adapter, EngineConfig(prefill_step=16, speculative_depth=depth))
    tokens, finish = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 24)))["a"]
    assert tokens == expected["a"]
    assert finish.speculative is not None and finish.speculative["accepted"] > 0
    # Three at once (the adapter's own drafts: random, nearly all rejected).
    engine = Engine(
        DSparkAdapter(model),
        EngineConfig(prefill_step=16, speculative_depth=depth, max_speculative_batch=3),
    )
    requests = [GenerationRequest(k, GenerationParams(p, 24)) for k, p in PROMPTS.items()]
    got = run(engine, *requests)
    for key, tokens_and_finish in got.items():
        assert tokens_and_finish[0] == expected[key], key
        speculative = tokens_and_finish[1].speculative
        assert speculative is not None and speculative["depth"] == depth


#: A calibration where a planned round (one host read) costs less than one that reads
#: its confidences first, and verifying more rows costs little (a GPU's shape).
PLANNED_PAYS = RoundCosts(
    plain=1.0,
    verify={m: 1.5 + 0.02 * m for m in range(5)},
    draft=0.1,
    rounds={k: 1.2 + 0.02 * k for k in range(1, 5)},
)


@pytest.mark.parametrize("planned", [True, False])
def test_a_seed_gives_one_answer_at_every_depth(model: Any, planned: bool) -> None:
    """Planned rounds verify every draft; the others decide on their confidences (no
    calibration: while their running product stays above one half)."""
    sampling = SamplingParams(temperature=0.8, seed=5)
    answers = []
    for depth in (0, 1, 3):
        adapter = DSparkAdapter(model)
        adapter.verify_all = planned
        engine = Engine(adapter, EngineConfig(prefill_step=16, speculative_depth=depth))
        request = GenerationRequest("s", GenerationParams(PROMPT, 20, sampling))
        answers.append(run(engine, request)["s"][0])
    assert answers[0] == answers[1] == answers[2]


def test_confidence_decides_how_many_drafts_are_verified(model: Any) -> None:
    adapter = DSparkAdapter(model)
    high, low = mx.array([0.95, 0.9, 0.9, 0.2]), mx.array([0.3, 0.9, 0.9, 0.9])
    # Without costs: while the running product stays above one half.
    assert adapter._verified(high, 4) == 3 and adapter._verified(low, 4) == 0
    # With costs: the most expected tokens per second. A verify of many tokens that costs
    # little (a GPU) verifies deeper than one that grows with its tokens (a CPU).
    cheap = RoundCosts(plain=1.0, verify={m: 1.2 + 0.01 * m for m in range(5)}, draft=0.2)
    dear = RoundCosts(plain=1.0, verify={m: 1.2 + 0.6 * m for m in range(5)}, draft=0.2)
    adapter.costs = cheap
    assert adapter._verified(high, 4) == 4
    adapter.costs = dear
    assert adapter._verified(high, 4) < 4
    # The automatic depth learns the confidences as its prior guess per position.
    picker = DepthPicker(max_depth=4, calibrated=cheap)
    adapter.follow(picker)
    adapter._verified(low, 4)
    assert picker.prior()[0] == pytest.approx(0.3)


def test_a_plan_is_made_where_a_planned_round_pays(model: Any) -> None:
    adapter = DSparkAdapter(model)
    state = adapter.new_state(max_rollback=5)
    # No calibration, or no confidences seen yet: the round reads its own first.
    state.profile = [0.9, 0.9, 0.9, 0.9]
    assert adapter._plan(state, 4) is None
    adapter.costs = PLANNED_PAYS
    assert adapter._plan(DSparkState([]), 4) is None
    # Planned rounds cheaper than reading first, rows cheap: all four verified.
    assert adapter._plan(state, 4) == 4
    # Confident only of the first draft, rows dear: fewer.
    dear = RoundCosts(
        plain=1.0,
        verify={m: 9.0 for m in range(5)},
        rounds={k: 1.0 + 0.5 * k for k in range(1, 5)},
    )
    adapter.costs = dear
    state.profile = [0.9, 0.2, 0.2, 0.2]
    assert adapter._plan(state, 4) == 1
    # A round that reads its confidences first is the cheaper kind: no plan.
    adapter.costs = RoundCosts(
        plain=1.0,
        verify={m: 1.0 + 0.02 * m for m in range(5)},
        rounds={k: 2.0 for k in range(1, 5)},
    )
    state.profile = [0.9, 0.9, 0.9, 0.9]
    assert adapter._plan(state, 4) is None
    # An engine on stored costs (planned rounds only, no calibration here) plans on them.
    stored = DSparkAdapter(model)
    rounds = {k: 1.2 + 0.02 * k for k in range(1, 5)}
    stored.follow(DepthPicker(max_depth=4, calibrated=RoundCosts(plain=1.0, rounds=rounds)))
    assert stored._plan(state, 4) == 4


def test_planned_rounds_keep_greedy_output_and_learn_the_confidences(model: Any) -> None:
    """Planned rounds read the confidences back with the verdict: the request's running
    ones (and the automatic depth's) follow them, and the next request starts from them."""
    expected = plain(model, {"a": PROMPT}, 24)["a"]
    adapter = Planning(model)
    adapter.costs = PLANNED_PAYS
    picker = DepthPicker(max_depth=4, calibrated=PLANNED_PAYS)
    adapter.follow(picker)
    engine = Engine(adapter, EngineConfig(prefill_step=16, speculative_depth=4))
    tokens, finish = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 24)))["a"]
    assert tokens == expected
    speculative = finish.speculative
    assert speculative is not None and speculative["drafted"] > 0
    # The first round had no confidences to plan on; the rest were planned.
    assert len(adapter.plans) > 2 and adapter.plans[0] is None
    assert all(plan is not None for plan in adapter.plans[1:])
    assert adapter.profile is not None and len(adapter.profile) == 4
    assert all(0.0 < c < 1.0 for c in adapter.profile)
    assert picker.confidence(3) is not None
    assert adapter._plan(DSparkState([]), 4) == 4  # a new request plans from the start


@pytest.mark.parametrize("planned", [True, False])
def test_a_penalised_request_at_depth_k_equals_depth_0(model: Any, planned: bool) -> None:
    """A request with a `TokenChooser` (penalties, logprobs) drafts and verifies under its
    transforms (`speculate_chosen`), planned or deciding on its confidences."""
    sampling = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logprobs=2)
    request = GenerationRequest("p", GenerationParams(PROMPT, 24, sampling))
    expected = run(
        Engine(DSparkAdapter(model), EngineConfig(prefill_step=16, speculative_depth=0)), request
    )["p"][0]
    adapter = DSparkAdapter(model)
    adapter.costs = PLANNED_PAYS if planned else None
    adapter.profile = [0.9] * 4 if planned else None
    engine = Engine(adapter, EngineConfig(prefill_step=16, speculative_depth=4))
    tokens, finish = run(engine, request)["p"]
    assert tokens == expected
    assert finish.speculative is not None and finish.speculative["drafted"] > 0


def test_the_calibration_times_both_kinds_of_round(model: Any) -> None:
    adapter = DSparkAdapter(model)
    costs = adapter.measure_costs()
    assert adapter.costs is not None
    assert sorted(adapter.costs.verify) == list(range(5))  # read first, verifying 0 .. 4
    assert sorted(adapter.costs.rounds) == sorted(costs.rounds) == [1, 2, 3, 4]  # planned
    assert all(v > 0 for v in (*adapter.costs.verify.values(), *costs.rounds.values()))
    assert adapter.profile is None  # the probes' confidences are not a request's


def test_speculative_sampling_keeps_the_distribution() -> None:
    """Rejection sampling keeps the target distribution: the first token of many depth-2
    rounds (from one state; unseeded draws, a head 4x sharper than the main model, every
    draft verified) against the main model's own probabilities, chi-square goodness of
    fit. Unchecked drafts would follow the head instead."""
    from scipy.stats import chisquare

    sharp = tiny_dspark(sharp=4.0)
    adapter = DSparkAdapter(sharp)
    adapter.verify_all = True
    params = SamplingParams(temperature=1.0)
    state = adapter.new_state(max_rollback=4)
    adapter.prefill(state, list(PROMPT[:11]))
    last = PROMPT[11]
    probe = adapter.snapshot(state)
    target = mx.softmax(adapter.step(probe, mx.array([last])), axis=-1)
    runs, counts = 240, [0] * int(target.shape[-1])
    kept = 0
    for seed in range(runs):
        tokens, _, accepted = adapter.speculate(
            adapter.snapshot(state), last, 2, params, KeyStream(1000 + seed, False).at(0)
        )
        counts[tokens[0]] += 1
        kept += accepted > 0
    assert 0 < kept < runs  # drafts were kept and rejected
    # Six bins of ids (about ten tokens, forty draws each): the sharp head's favourite
    # token would swell its bin if its drafts were kept unchecked.
    p = [float(v) for v in target.tolist()]
    bins = 6
    observed = [sum(counts[t] for t in range(len(p)) if t % bins == b) for b in range(bins)]
    expected = [runs * sum(p[t] for t in range(len(p)) if t % bins == b) for b in range(bins)]
    expected = [e * runs / sum(expected) for e in expected]
    assert chisquare(observed, expected).pvalue > 0.001
