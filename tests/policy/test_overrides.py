"""Overrides: applied where allowed, recorded in the plan, warned when risky."""

import pytest

from mlxserve.errors import UsageError
from tests.policy.conftest import PlanFor

MIXED = "Apple M3 Ultra,Apple M5 Max"
HOMOGENEOUS = "Apple M5 Max,Apple M5 Max"


def test_force_skip_on_mixed_cluster_warns_and_keeps_non_nax_rank_off(plan_for: PlanFor) -> None:
    plan = plan_for(MIXED, nax_moe="skip")
    assert [plan.nax_moe(r) for r in range(2)] == ["off", "skip"]
    assert plan.ranks[1].decisions["nax_moe"].rule == "override"
    assert "nax-moe-mixed-cluster-full" in plan.ranks[1].decisions["nax_moe"].reason
    assert [w.rule for w in plan.warnings] == ["nax-moe-mixed-cluster-full"]
    assert "contradicts hazard rule nax-moe-mixed-cluster-full" in plan.warnings[0].message
    (override,) = plan.overrides
    assert (override.key, override.value, override.rank) == ("nax_moe", "skip", None)
    assert override.applied_to == [1]
    assert override.source == "policy.nax_moe"


def test_force_full_on_homogeneous_cluster_is_silent(plan_for: PlanFor) -> None:
    plan = plan_for(HOMOGENEOUS, nax_moe="full")
    assert [plan.nax_moe(r) for r in range(2)] == ["full", "full"]
    assert plan.warnings == []


def test_auto_is_no_override(plan_for: PlanFor) -> None:
    plan = plan_for(MIXED, nax_moe="auto")
    assert plan.overrides == []
    assert plan.plan_hash == plan_for(MIXED).plan_hash


def test_per_rank_override(plan_for: PlanFor) -> None:
    plan = plan_for(HOMOGENEOUS, overrides=("nax_moe@1=full",))
    assert [plan.nax_moe(r) for r in range(2)] == ["skip", "full"]
    assert plan.overrides[0].applied_to == [1]


def test_per_rank_override_on_rank_without_nax_is_not_applied(plan_for: PlanFor) -> None:
    plan = plan_for(MIXED, overrides=("nax_moe@0=skip",))
    assert [plan.nax_moe(r) for r in range(2)] == ["off", "full"]
    assert plan.overrides[0].applied_to == []


def test_later_override_wins(plan_for: PlanFor) -> None:
    plan = plan_for(HOMOGENEOUS, nax_moe="full", overrides=("nax_moe@0=skip",))
    assert [plan.nax_moe(r) for r in range(2)] == ["skip", "full"]


def test_world_overrides(plan_for: PlanFor) -> None:
    plan = plan_for(
        "Apple M5 Max:mlx=0.31.2,Apple M5 Max:mlx=0.31.2",
        backend="jaccl",
        overrides=("startup=allow", "progress_timeout_s=60"),
    )
    assert plan.world_value("startup") == "allow"
    assert plan.progress_timeout_s() == 60.0
    assert [w.rule for w in plan.warnings] == ["jaccl-mesh-allreduce-race"]
    plan.ensure_startable()


def test_rows_floor_override(plan_for: PlanFor) -> None:
    plan = plan_for(HOMOGENEOUS, overrides=("moe_rows_per_expert_min=32",))
    assert plan.rank_value(0, "moe_rows_per_expert_min") == 32


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus=1", "unknown decision 'bogus'"),
        ("nax_moe=fast", "nax_moe must be one of skip, full, off"),
        ("nax_moe", "expected KEY=VALUE"),
        ("=full", "expected KEY=VALUE"),
        ("nax_moe@x=full", "rank must be a number"),
        ("nax_moe@7=full", "rank 7 does not exist"),
        ("startup@0=allow", "decided for the whole cluster"),
        ("progress_timeout_s=soon", "progress_timeout_s must be a float"),
        ("progress_timeout_s=0", "progress_timeout_s must be >="),
        ("moe_rows_per_expert_min=1.5", "must be a whole number"),
    ],
)
def test_bad_overrides_are_errors(plan_for: PlanFor, text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        plan_for(HOMOGENEOUS, overrides=(text,))
