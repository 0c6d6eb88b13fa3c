"""The tensor-parallel split the policy proposes for simulated clusters, and overrides."""

import pytest

from mlxserve.errors import UsageError
from mlxserve.hardware.catalog import memory_bandwidth_gbs
from mlxserve.hardware.composition import Cluster
from mlxserve.hardware.simulate import parse_cluster_spec, simulated_profile
from mlxserve.policy.calibration import Verdict
from mlxserve.policy.evaluate import evaluate
from mlxserve.policy.explain import explain_text
from mlxserve.policy.rules import load_rules
from mlxserve.policy.split import (
    EVEN_RULE,
    FULL_COST,
    OVERRIDE_RULE,
    SPLIT_RULE,
    WEIGHT_SHARE,
    ModelShape,
    decide_split,
    full_cost,
    propose_split,
)

GIB = 2**30
#: A DeepSeek-V4-Flash-like model: 8 output groups, FP4 experts (150 GiB, top-6 of 256
#: read per step), 8 GiB replicated.
FLASH = ModelShape(
    granularity=8,
    replicated_bytes=8 * GIB,
    sharded_bytes=150 * GIB,
    replicated_read=6 * GIB,
    sharded_read=4 * GIB,
)


def cluster(spec: str) -> Cluster:
    ranks = parse_cluster_spec(spec)
    profiles = [simulated_profile(i, r, "0.32.4", "0.32.2") for i, r in enumerate(ranks)]
    return Cluster(ranks=profiles, backend="jaccl")


def plan(spec: str, shape: ModelShape | None = FLASH, split: list[int] | None = None):  # type: ignore[no-untyped-def]
    return evaluate(cluster(spec), load_rules(None), [], model=shape, split=split)


def test_a_homogeneous_cluster_splits_evenly() -> None:
    decision = plan("Apple M3 Ultra,Apple M3 Ultra").split
    assert decision is not None
    assert decision.shares == [1, 1] and decision.rule == EVEN_RULE
    assert decision.estimates[0].step_ms == decision.estimates[1].step_ms


def test_the_faster_rank_takes_more_when_bandwidth_and_full_differ() -> None:
    """M3 Ultra (819 GB/s, no NAX) + M5 Max (614 GB/s, runs ``full``): the Ultra takes
    3 of 4 parts, and the slowest rank's estimated step is shorter than with even."""
    mixed = plan("Apple M3 Ultra:memory=512,Apple M5 Max")
    decision = mixed.split
    assert decision is not None
    assert [r.decisions["nax_moe"].value for r in mixed.ranks] == ["off", "full"]
    assert decision.shares == [3, 1] and decision.rule == SPLIT_RULE
    assert decision.estimates[1].cost == FULL_COST
    even = decide_split(
        cluster("Apple M3 Ultra:memory=512,Apple M5 Max"), ["off", "full"], FLASH, override=[1, 1]
    )
    slowest = max(e.step_ms or 0 for e in decision.estimates)
    assert slowest < max(e.step_ms or 0 for e in even.estimates) / 1.05
    assert "819 GB/s" in decision.reason and "614 GB/s" in decision.reason


def test_the_shard_must_fit_the_smaller_rank() -> None:
    """A 64 GiB Mac (48 GiB usable, 90% of it for weights) cannot hold half of 150 GiB,
    nor a quarter (45.5 GiB): it gets an eighth."""
    decision = plan("Apple M3 Ultra:memory=512,Apple M3 Ultra:memory=64").split
    assert decision is not None
    assert decision.shares == [7, 1]
    assert "does not fit rank 1" in decision.reason
    for estimate in decision.estimates:
        assert estimate.held_bytes <= estimate.usable_bytes * WEIGHT_SHARE


def test_a_model_that_fits_nowhere_stays_even_and_says_so() -> None:
    decision = plan("Apple M5 Max:memory=16,Apple M5 Max:memory=16").split
    assert decision is not None
    assert decision.shares == [1, 1] and "no split fits" in decision.reason


def test_near_balance_keeps_the_even_split() -> None:
    """M4 Max (546 GB/s) + M5 Max running full (614 / 1.07): under the 5% that moves it."""
    decision = plan("Apple M4 Max,Apple M5 Max").split
    assert decision is not None
    assert decision.shares == [1, 1] and "under the 1.05x" in decision.reason


def test_unknown_bandwidth_counts_ranks_as_equals() -> None:
    assert memory_bandwidth_gbs("Linux CPU") is None
    decision = plan("cpu:memory=256,cpu:memory=512").split
    assert decision is not None
    assert decision.shares == [1, 1]
    assert all(e.step_ms is None for e in decision.estimates)
    # Memory still counts: 64 GiB cannot hold half of the experts.
    small = plan("cpu:memory=64,cpu:memory=512").split
    assert small is not None and small.shares == [1, 3]
    assert "bandwidth is unknown" in small.reason


def test_an_unknown_model_splits_evenly() -> None:
    decision = plan("Apple M3 Ultra:memory=512,Apple M5 Max", shape=None).split
    assert decision is not None
    assert decision.shares == [1, 1] and "not known before it loads" in decision.reason


def test_the_cost_of_full_comes_from_a_calibration_when_there_is_one() -> None:
    profile = cluster("Apple M5 Max").ranks[0]

    def verdict(variant: str, baseline: str, ratio: float) -> Verdict:
        return Verdict(
            chip=profile.chip,
            device_type="metal",
            mlx_version=profile.mlx_version,
            calibrated_on="2026-12-01",
            variant=variant,
            chunk=512,
            baseline=baseline,
            ratio=ratio,
        )

    assert full_cost(profile, "skip", []) == 1.0
    assert full_cost(profile, "full", []) == FULL_COST
    assert full_cost(profile, "full", [verdict("skip", "full", 1.4)]) == 1.4
    assert full_cost(profile, "full", [verdict("full", "skip", 2.0)]) == 1.0


def test_an_override_replaces_the_choice_and_is_explained() -> None:
    overridden = plan("Apple M3 Ultra,Apple M3 Ultra", split=[1, 3])
    decision = overridden.split
    assert decision is not None
    assert decision.shares == [1, 3] and decision.rule == OVERRIDE_RULE
    assert "the policy chose 1+1 of 2 parts" in decision.reason
    assert overridden.tensor_split() == [1, 3]
    assert overridden.plan_hash != plan("Apple M3 Ultra,Apple M3 Ultra").plan_hash
    text = explain_text(overridden)
    assert "tensor_split: 1+3 of 4 parts [split-override]" in text
    assert "rank 1: 3 part(s)" in text


@pytest.mark.parametrize(
    ("split", "named"),
    [
        ([2, 1], r"cluster\.split \[2, 1\]: 3 parts do not divide the model's 8"),
        ([1, 1, 2], r"3 shares for 2 ranks"),
    ],
)
def test_an_override_that_cannot_be_honoured_is_refused_by_name(
    split: list[int], named: str
) -> None:
    with pytest.raises(UsageError, match=named):
        plan("Apple M3 Ultra,Apple M5 Max", split=split)


def test_one_rank_and_the_plan_document() -> None:
    single = plan("Apple M5 Max")
    assert single.tensor_split() == [1]
    document = plan("Apple M3 Ultra:memory=512,Apple M5 Max").document()
    assert document["split"]["shares"] == [3, 1]
    assert document["split"]["estimates"][0]["bandwidth_gbs"] == 819


def test_propose_never_exceeds_the_model_granularity() -> None:
    coarse = FLASH.model_copy(update={"granularity": 2})
    decision = propose_split(
        cluster("Apple M3 Ultra:memory=512,Apple M5 Max"), ["off", "full"], coarse
    )
    assert decision.shares == [1, 1]


def test_three_ranks_split_a_model_of_eight_parts_as_evenly_as_it_can() -> None:
    """8 output groups do not divide over 3 ranks; 3+3+2 of 8 parts does."""
    decision = plan("Apple M3 Ultra,Apple M3 Ultra,Apple M3 Ultra").split
    assert decision is not None
    assert decision.shares == [3, 3, 2] and decision.rule == SPLIT_RULE
    assert "3 ranks cannot split the model's 8 parts evenly" in decision.reason
    too_many = propose_split(cluster(",".join(["Apple M3 Ultra"] * 16)), ["off"] * 16, FLASH)
    assert too_many.shares == [1] * 16 and "at most 8 parts" in too_many.reason
