"""MTP speculative decoding on DeepSeek-V4: greedy output identical to plain decoding."""

import itertools
import time

import mlx.core as mx
import pytest
from mlx.nn.layers.base import Module

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core import stepper
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.request_state import RequestState
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.sample.sampling import KeyStream
from mlxserve.engine.spec.costs import RoundCosts
from mlxserve.engine.spec.depth import (
    MIN_OBSERVED,
    PROBE_EVERY,
    PROBE_NEAR_EVERY,
    RECHECK_EVERY,
    DepthPicker,
)
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.drive import run
from tests.engine.v4_models import tiny_v4

# Longer than the sliding window (8) and several compression groups (4 and 16).
PROMPT = tuple((7 * i + 3) % 61 for i in range(45))
# Round costs in plain steps: dear rounds (a CPU-like verify), a near call, cheap rounds.
DEAR = RoundCosts(plain=1.0, verify={k: 1.0 + 0.3 * k for k in range(1, 6)}, draft=0.33)
CLOSE = RoundCosts(plain=1.0, rounds={1: 1.5, 2: 1.9, 3: 2.6, 4: 3.3, 5: 4.0})
CHEAP = RoundCosts(plain=1.0, verify={k: 1.0 + 0.02 * k for k in range(1, 6)}, draft=0.025)


@pytest.fixture(scope="module")
def v4() -> Module:
    return tiny_v4()


def plain_greedy(model: Module, prompt: tuple[int, ...], n: int) -> list[int]:
    """Reference: no engine, no cache: a full forward for every new token."""
    tokens = list(prompt)
    out = []
    for _ in range(n):
        logits = model(mx.array(tokens)[None])
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        tokens.append(token)
    return out


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 5])
def test_greedy_speculation_equals_plain_decoding(v4: Module, depth: int) -> None:
    expected = plain_greedy(v4, PROMPT, 30)
    engine = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth=depth))
    tokens, finish = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 30)))["a"]
    assert tokens == expected
    assert finish.finish_reason == "length"
    if depth:
        assert finish.speculative is not None
        assert finish.speculative["depth"] == depth
        assert finish.speculative["drafted"] > 0
        per_depth = finish.speculative["acceptance_rate_per_depth"]
        assert isinstance(per_depth, list) and len(per_depth) == depth


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_automatic_depth_keeps_the_output(v4: Module, temperature: float) -> None:
    """Rounds at the depths it chooses, plain steps in between: greedy output equals
    plain decoding, and a seeded sample is the one depth 0 draws (coupled draws)."""
    engine = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth="auto"))
    assert engine.auto and engine.depth == 5
    sampling = SamplingParams(temperature=temperature, seed=3)
    request = GenerationRequest("a", GenerationParams(PROMPT, 40, sampling))
    tokens, finish = run(engine, request)["a"]
    assert finish.speculative is not None
    chosen = finish.speculative["depths_chosen"]
    assert isinstance(chosen, dict) and sum(chosen.values()) > 0
    assert finish.speculative["depth"] == "auto"
    if temperature == 0:
        assert tokens == plain_greedy(v4, PROMPT, 40)
    else:
        plain = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth=0))
        again, _ = run(plain, GenerationRequest("b", GenerationParams(PROMPT, 40, sampling)))["b"]
        assert len(tokens) == 40 and again == tokens


def test_a_plain_request_probes_less_and_less_while_probes_fail(v4: Module) -> None:
    """Depth 1 priced far out (dear rounds, earlier requests' drafts all rejected): a
    request decodes plainly and probes after 32 plain steps, then after 64 more
    (`MAX_PROBE_BACKOFF`), not every 32 (four probes in 140 tokens); output unchanged."""
    engine = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth="auto"))
    picker = DepthPicker(max_depth=5, calibrated=DEAR, follow_observed=False)
    for _ in range(200):
        picker.record(1, 0)
    engine.depth_picker = engine.runner.depth_picker = picker
    tokens, finish = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 140)))["a"]
    plain = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth=0))
    assert tokens == run(plain, GenerationRequest("b", GenerationParams(PROMPT, 140)))["b"][0]
    assert finish.speculative is not None
    assert finish.speculative["depths_chosen"]["1"] == 2


def recorded_gaps(picker: DepthPicker) -> list[float]:
    """The times between steps `picker` observes from now on, in order."""
    gaps: list[float] = []
    observe = picker.observe_between

    def recorded(seconds: float) -> None:
        gaps.append(seconds)
        observe(seconds)

    picker.observe_between = recorded  # type: ignore[method-assign]
    return gaps


def test_the_time_between_a_requests_steps_is_observed(v4: Module) -> None:
    """Every step of a request after its first is preceded by the engine's own work,
    timed from the end of the one before (`DepthPicker.overhead`); nothing is timed
    across a prefill or from another request's step."""
    engine = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth="auto"))
    picker = DepthPicker(max_depth=5, calibrated=DEAR)
    engine.depth_picker = engine.runner.depth_picker = picker
    kinds: list[tuple[str, tuple[str, ...]]] = []
    run_step = engine.runner.run

    def counted(plan, sequences):  # type: ignore[no-untyped-def]
        kinds.append((plan.kind, plan.request_ids))
        return run_step(plan, sequences)

    engine.runner.run = counted  # type: ignore[method-assign]
    gaps = recorded_gaps(picker)
    for rid in ("a", "b"):
        run(engine, GenerationRequest(rid, GenerationParams(PROMPT, 12)))
    following = sum(
        1
        for before, after in itertools.pairwise(kinds)
        if before[0] != "prefill" and after[0] != "prefill" and before[1] == after[1]
    )
    assert following >= 2 * 8  # most of both requests' steps
    assert len(gaps) == following
    assert all(gap >= 0 for gap in gaps) and picker.overhead() > 0


def test_no_gap_is_timed_across_the_calibration(
    v4: Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The depth calibration runs between a request's first step and its next one, and
    switches the runner to the clock that times rounds (CPU time on a CPU, whose zero
    is not the wall clock's; here a clock 1000 s ahead, so the test does not depend on
    where the two zeros happen to lie): neither the calibration's time nor the two
    clocks' difference may enter the engine's time between steps."""

    def ahead() -> float:
        return time.perf_counter() + 1000.0

    monkeypatch.setattr(stepper, "cost_clock", lambda: ahead)
    engine = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth="auto"))
    measure = engine.adapter.measure_costs  # type: ignore[attr-defined]
    spent: list[float] = []

    def timed(**kwargs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        costs = measure(**kwargs)
        spent.append(time.perf_counter() - started)
        return costs

    engine.adapter.measure_costs = timed  # type: ignore[attr-defined]
    gaps: list[float] = []
    observe = DepthPicker.observe_between

    def recorded(picker: DepthPicker, seconds: float) -> None:
        gaps.append(seconds)
        observe(picker, seconds)

    monkeypatch.setattr(DepthPicker, "observe_between", recorded)
    run(engine, GenerationRequest("a", GenerationParams(PROMPT, 24)))
    assert engine.depth_picker is not None and len(spent) == 1
    assert gaps  # the request's later steps were timed
    assert all(0 <= gap < spent[0] / 2 for gap in gaps), (gaps, spent)


def test_no_gap_is_timed_across_a_request_that_comes_back(v4: Module) -> None:
    """A finished id may come back (a caller's own ids); with its prompt in the prefix
    cache it needs no prefill, and the wait in between is not the engine's."""
    engine = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth="auto"))
    picker = DepthPicker(max_depth=5, calibrated=DEAR)
    engine.depth_picker = engine.runner.depth_picker = picker
    gaps = recorded_gaps(picker)
    idle = 0.3
    for _ in range(2):
        run(engine, GenerationRequest("same", GenerationParams(PROMPT, 8)))
        time.sleep(idle)
    assert gaps and max(gaps) < idle / 2, gaps


def test_only_far_probes_space_out_and_drafting_resets_them(v4: Module) -> None:
    """`Engine._depth_for` counts a request's far probes (after PROBE_EVERY plain steps
    or more), not its near ones (after PROBE_NEAR_EVERY), and forgets them once the
    request chooses to draft."""
    engine = Engine(MTPAdapter(v4), EngineConfig(speculative_depth="auto"))
    sequence = RequestState(
        GenerationRequest("a", GenerationParams(PROMPT, 64)), KeyStream(0), depth=5, auto=True
    )
    sequence.chosen_depth = 0

    far = DepthPicker(max_depth=5, calibrated=DEAR, follow_observed=False)
    for _ in range(200):
        far.record(1, 0)
    engine.depth_picker = far
    sequence.plain_streak = PROBE_EVERY
    assert engine._depth_for(sequence) == 1 and sequence.probes == 1

    near = DepthPicker(max_depth=5, calibrated=CLOSE)
    for _ in range(1 + MIN_OBSERVED):
        near.observe(0, 1.0)
        near.observe(1, 1.5)
    for kept in (1, 0) * 20:
        sequence.stats.record(1, kept)  # a first draft kept half the time
    engine.depth_picker = near
    sequence.plain_streak = PROBE_NEAR_EVERY
    assert engine._depth_for(sequence) == 1 and sequence.probes == 1  # near: not counted

    paying = DepthPicker(max_depth=5, calibrated=CHEAP, follow_observed=False)
    for _ in range(200):
        paying.record(1, 1)
    for _ in range(40):
        sequence.stats.record(1, 1)
    engine.depth_picker = paying
    sequence.plain_streak = RECHECK_EVERY
    assert engine._depth_for(sequence) > 0 and sequence.chosen_depth
    assert sequence.probes == 0


def test_prefix_cache_hit_keeps_speculation_exact(v4: Module) -> None:
    engine = Engine(MTPAdapter(v4), EngineConfig(prefill_step=16, speculative_depth=3))
    first, _ = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 20)))["a"]
    extended = (*PROMPT, *first[:5])
    second, finish = run(engine, GenerationRequest("b", GenerationParams(extended, 20)))["b"]
    assert finish.usage.cached_tokens == len(PROMPT) - 1
    assert second == plain_greedy(v4, extended, 20)


def test_depth_limited_by_budget(v4: Module) -> None:
    engine = Engine(MTPAdapter(v4), EngineConfig(speculative_depth=5))
    tokens, finish = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 3)))["a"]
    assert tokens == plain_greedy(v4, PROMPT, 3)
    assert finish.usage.completion_tokens == 3


def test_sampling_with_seed_is_reproducible(v4: Module) -> None:
    engine = Engine(MTPAdapter(v4), EngineConfig(speculative_depth=3, prefix_cache_entries=0))
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    first = run(engine, GenerationRequest("a", GenerationParams(PROMPT, 16, sampling)))["a"][0]
    second = run(engine, GenerationRequest("b", GenerationParams(PROMPT, 16, sampling)))["b"][0]
    assert first == second and len(first) == 16


def test_rollback_leaves_exactly_the_state_of_the_emitted_tokens(v4: Module) -> None:
    """Sampling accepts drafts often; after every round the caches must equal a fresh
    run over prompt + emitted tokens: same next logits, same MTP draft."""
    from mlxserve.engine.sample.sampling import KeyStream

    adapter = MTPAdapter(v4)
    state = adapter.new_state(max_rollback=4)
    adapter.prefill(state, list(PROMPT[:-1]))
    logits = adapter.step(state, mx.array(PROMPT[-1:]))
    tokens = [*PROMPT, int(mx.argmax(logits).item())]
    keys = KeyStream(3)
    accepted_total = 0
    for _ in range(8):
        emitted, _drafted, accepted = adapter.speculate(
            state,
            tokens[-1],
            4,
            SamplingParams(temperature=3.0, seed=1),
            keys.at(len(tokens) - len(PROMPT)),
        )
        accepted_total += accepted
        tokens += emitted
        # Main model: the state's next logits equal a fresh forward's.
        probe = adapter.snapshot(state)
        ours = adapter.step(probe, mx.array(tokens[-1:]))
        fresh = v4(mx.array(tokens)[None])[0, -1]
        assert mx.allclose(ours, fresh, atol=1e-4).item()
        # MTP: its depth-1 draft from the kept state equals one from scratch.
        # The carry (rows whose MTP entries wait for the next round's first draft)
        # goes in with its successors, as the next round feeds it.
        assert probe.carry is not None
        carried = mx.concatenate([*probe.carry_tokens, mx.array([7])])[None]
        draft, _ = v4.mtp_forward(probe.carry, carried, probe.mtp_cache[0], 0)
        streams = v4.forward_hidden(mx.array(tokens)[None])
        successors = mx.array([*tokens[1:], 7])[None]
        ref, _ = v4.mtp_forward(streams, successors, v4.make_mtp_cache()[0], 0)
        assert mx.allclose(draft[0, -1], ref[0, -1], atol=1e-4).item()
    assert accepted_total > 0  # the accepted path was exercised


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_syncs_with_the_host_once(
    v4: Module, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts, verify, acceptance and rollback: one `mx.eval`, and nothing read back
    before it (an `.item()` on a lazy array would be a second sync)."""
    from mlxserve.engine.sample.sampling import KeyStream
    from mlxserve.engine.spec import mtp as mtp_adapter

    adapter = MTPAdapter(v4)
    state = adapter.new_state(max_rollback=3)
    adapter.prefill(state, list(PROMPT[:-1]))
    first = int(mx.argmax(adapter.step(state, mx.array(PROMPT[-1:]))).item())
    evals: list[int] = []
    real_eval = mx.eval

    def counting_eval(*args: object) -> None:
        evals.append(1)
        real_eval(*args)

    monkeypatch.setattr(mtp_adapter.mx, "eval", counting_eval)
    draws = KeyStream(5).at(1)
    emitted = adapter.speculate(state, first, 3, SamplingParams(temperature=temperature), draws)[0]
    monkeypatch.setattr(mtp_adapter.mx, "eval", real_eval)
    assert evals == [1]
    assert 1 <= len(emitted) <= 4


def test_trim_beyond_the_rollback_margin_is_an_error(v4: Module) -> None:
    cache = v4.make_cache(max_rollback=2)
    v4(mx.array([list(PROMPT[:20])]), cache=cache)
    assert cache[0].trim(2) == 2
    with pytest.raises(ValueError, match="cannot trim 3"):
        cache[0].trim(3)


@pytest.mark.slow
def test_speculative_sampling_keeps_the_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chi-square two-sample tests on tokens 2 and 3 of many short sampled runs:
    drafting (rejection sampling, depth 2) vs plain sampling. Token 1 is always
    sampled plainly; tokens 2-3 come from one draft + verify round. The drafter is
    made 4x sharper than the main model, so keeping its drafts unchecked would
    change the distribution. Unseeded (a seeded request's rounds draw its depth-0
    tokens), with the entropy the engine draws keys from made repeatable."""
    from scipy.stats import chi2_contingency

    from mlxserve.engine.sample import sampling as sampling_module

    v4 = tiny_v4()
    v4.mtp[0].norm.weight = v4.mtp[0].norm.weight * 4
    entropy = iter(range(10**6))
    monkeypatch.setattr(sampling_module.secrets, "randbits", lambda bits: next(entropy))

    def samples(depth: int, runs: int) -> list[list[int]]:
        engine = Engine(MTPAdapter(v4), EngineConfig(speculative_depth=depth))
        out = []
        for seed in range(runs):
            sampling = SamplingParams(temperature=0.6)
            request = GenerationRequest(f"r{seed}", GenerationParams(PROMPT[:12], 3, sampling))
            out.append(run(engine, request)[f"r{seed}"][0])
        return out

    runs = 250
    plain, drafted = samples(0, runs), samples(2, runs)
    for position in (1, 2):
        a = [tokens[position] for tokens in plain]
        b = [tokens[position] for tokens in drafted]
        frequent = sorted({t for t in a + b if a.count(t) + b.count(t) >= 10})
        assert len(frequent) >= 2  # there are bins to compare
        table = [
            [x.count(t) for t in frequent] + [sum(1 for v in x if v not in frequent)]
            for x in (a, b)
        ]
        if table[0][-1] + table[1][-1] == 0:
            table = [row[:-1] for row in table]
        assert chi2_contingency(table).pvalue > 0.001
