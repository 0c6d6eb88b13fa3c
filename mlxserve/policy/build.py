"""From settings to a plan: discover the cluster, load rules, apply overrides."""

from mlxserve.cluster.discover import Membership, discover
from mlxserve.cluster.exchange import check_same_plan, gather_verdicts
from mlxserve.config import Settings, resolved_state_dir
from mlxserve.policy.calibration_store import load_verdicts
from mlxserve.policy.engine import evaluate
from mlxserve.policy.overrides import collect_overrides
from mlxserve.policy.plan import Plan
from mlxserve.policy.rules import load_rules


def build_plan(settings: Settings) -> tuple[Plan, Membership]:
    # Validate rules and overrides before touching MLX distributed, so bad
    # input fails fast and identically on every rank.
    ruleset = load_rules(settings.policy.rules_dir)
    overrides = collect_overrides(settings.policy.nax_moe, settings.policy.overrides)
    verdicts = load_verdicts(resolved_state_dir(settings.server))
    membership = discover(settings.cluster)
    if membership.group is not None:
        verdicts = gather_verdicts(membership.group, verdicts)
    plan = evaluate(membership.cluster, ruleset, overrides, verdicts)
    if membership.group is not None:
        check_same_plan(membership.group, plan.plan_hash)
    return plan, membership
