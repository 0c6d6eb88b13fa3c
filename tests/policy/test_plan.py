"""The plan document and its hash."""

from mlxserve.policy.plan import Plan
from tests.policy.conftest import PlanFor


def test_same_inputs_same_hash(plan_for: PlanFor) -> None:
    first = plan_for("Apple M3 Ultra,Apple M5 Max", nax_moe="skip")
    second = plan_for("Apple M3 Ultra,Apple M5 Max", nax_moe="skip")
    assert first.plan_hash == second.plan_hash
    assert len(first.plan_hash) == 64


def test_hash_covers_order_overrides_and_versions(plan_for: PlanFor) -> None:
    hashes = {
        plan_for("Apple M3 Ultra,Apple M5 Max").plan_hash,
        plan_for("Apple M5 Max,Apple M3 Ultra").plan_hash,
        plan_for("Apple M3 Ultra,Apple M5 Max", nax_moe="skip").plan_hash,
        plan_for("Apple M3 Ultra,Apple M5 Max:mlx=0.32.2").plan_hash,
    }
    assert len(hashes) == 4


def test_document_round_trips_and_rehashes(plan_for: PlanFor) -> None:
    plan = plan_for("Apple M3 Ultra,Apple M5 Max")
    document = plan.document()
    assert document["ranks"][1]["decisions"]["nax_moe"] == {
        "value": "full",
        "rule": "nax-moe-mixed-cluster-full",
        "reason": plan.ranks[1].decisions["nax_moe"].reason,
    }
    assert {"plan_hash", "overrides", "simulated", "ranks", "world", "warnings"} <= set(document)
    again = Plan.model_validate(document)
    assert again.with_hash().plan_hash == plan.plan_hash
