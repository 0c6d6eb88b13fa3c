"""Evaluate rules over a cluster into a plan.

For each decision and each target (every rank, or the world), the matching
rule of highest priority decides (ties: the rule id that sorts first, so the
result never depends on file order). Overrides then replace values and are
recorded; an override that contradicts a hazard rule adds a warning naming it.

A speed rule (one that decides a value as ``fastest``) matches only a rank with a
calibration of its chip and mlx version; its value and reason come from that
calibration's verdict. Rule files keep it below every hazard rule, and overrides
apply after it, so a measurement never outranks a hazard or the operator.

Pure: the rules, overrides, verdicts, incident memory and model shape come in as data
(``mlxserve.startup.plan`` reads and gathers them); evaluating reads no file and talks
to no other rank, so every rank given the same inputs computes the same plan.
"""

from collections.abc import Callable, Sequence

from mlxserve.errors import UsageError
from mlxserve.hardware.composition import Cluster
from mlxserve.hardware.profile import RankProfile
from mlxserve.policy.calibration import STOCK, Verdict, verdict_for
from mlxserve.policy.conditions import conditions_hold
from mlxserve.policy.decisions import DECISIONS, FASTEST, DecisionSpec
from mlxserve.policy.plan import OVERRIDE_RULE, Decision, Override, Plan, RankPlan, Warning_
from mlxserve.policy.rules import Rule, RuleSet
from mlxserve.policy.split import ModelShape, decide_split
from mlxserve.reliability.incidents import IncidentRecord, latest_for

CALIBRATION = "calibration"
"""The `Warning_.rule` of warnings about calibration records."""

Resolve = Callable[[str, Rule], Decision]


def evaluate(
    cluster: Cluster,
    ruleset: RuleSet,
    overrides: list[Override],
    calibrations: Sequence[Verdict] = (),
    *,
    incidents: Sequence[IncidentRecord] = (),
    model: ModelShape | None = None,
    split: Sequence[int] | None = None,
) -> Plan:
    """The plan. `calibrations` are the verdicts speed rules read; `incidents` is the
    incident memory (rules with `when.incident` read it); `model` what the tensor-parallel
    split weighs (None: unknown, even split) and `split` the operator's override of it."""
    by_id = {rule.id: rule for rule in ruleset.rules}
    incident = latest_for(list(incidents), cluster.composition, [p.chip for p in cluster.ranks])
    pinned = incident is not None
    warnings: list[Warning_] = []
    ranks = []
    for rank, profile in enumerate(cluster.ranks):
        verdict, stale = verdict_for(
            profile.chip, profile.device_type, profile.mlx_version, calibrations
        )
        if stale is not None:
            warnings.append(_stale_warning(rank, profile, stale))
        matching = [
            r
            for r in ruleset.rules
            if r.scope == "rank"
            and conditions_hold(r.when, cluster, rank, pinned)
            and (verdict is not None or not r.speed)
        ]
        decisions = _decide(matching, "rank", f"rank {rank}", _resolver(profile, verdict, incident))
        warnings += [
            Warning_(rule=r.id, message=f"rank {rank}: {r.warn}")
            for r in sorted(matching, key=lambda r: r.id)
            if r.warn
        ]
        ranks.append(RankPlan(rank=rank, profile=profile.summary(), decisions=decisions))
    matching_world = [
        r
        for r in ruleset.rules
        if r.scope == "world" and conditions_hold(r.when, cluster, None, pinned)
    ]
    world = _decide(matching_world, "world", "the cluster", _plain(incident))
    for rule in sorted(matching_world, key=lambda r: r.id):
        if rule.warn:
            warnings.append(Warning_(rule=rule.id, message=rule.warn))

    applied = [_apply(o, ranks, world, by_id, warnings, cluster.world_size) for o in overrides]
    variants = [str(rank.decisions["nax_moe"].value) for rank in ranks]
    tensor_split = decide_split(cluster, variants, model, calibrations, split)
    plan = Plan(
        simulated=cluster.simulated,
        world_size=cluster.world_size,
        backend=cluster.backend,
        wires=cluster.wires,
        composition=cluster.composition,
        ranks=ranks,
        world=world,
        overrides=applied,
        warnings=warnings,
        rule_files=ruleset.sources,
        split=tensor_split,
    )
    return plan.with_hash()


def _reason(rule: Rule, incident: IncidentRecord | None) -> str:
    """The rule's reason; an incident rule's names the incident it read."""
    if not rule.when.incident or incident is None:
        return rule.reason
    return rule.reason.format(
        incident_at=incident.when(),
        incident_plan=incident.plan_hash[:12],
        incident_kind=incident.kind,
        incident_step=incident.step_kind or "unknown",
    )


def _stale_warning(rank: int, profile: RankProfile, stale: Verdict) -> Warning_:
    return Warning_(
        rule=CALIBRATION,
        message=f"rank {rank}: ignored the calibration of {stale.chip} from mlx "
        f"{stale.mlx_version} ({stale.calibrated_on}): this rank runs mlx {profile.mlx_version}; "
        "run `mlxserve policy calibrate` again",
    )


def _plain(incident: IncidentRecord | None) -> Resolve:
    """A rule's own value, with its reason (an incident rule's names the incident)."""

    def resolve(key: str, rule: Rule) -> Decision:
        return Decision(value=rule.decided(key), rule=rule.id, reason=_reason(rule, incident))

    return resolve


def _resolver(
    profile: RankProfile, verdict: Verdict | None, incident: IncidentRecord | None
) -> Resolve:
    """How a winning rule's value is read: from the rule, or for ``fastest`` the verdict."""

    def resolve(key: str, rule: Rule) -> Decision:
        if rule.decide[key] != FASTEST:
            return _plain(incident)(key, rule)
        assert verdict is not None  # speed rules only match calibrated ranks
        # The stock call is named `off` on a rank that has no NAX path.
        name = "off" if verdict.variant == STOCK and not profile.nax else verdict.variant
        value = DECISIONS[key].coerce(name)
        return Decision(value=value, rule=rule.id, reason=verdict.reason(str(value)))

    return resolve


def _decide(matching: list[Rule], scope: str, target: str, resolve: Resolve) -> dict[str, Decision]:
    decisions = {}
    for key, spec in DECISIONS.items():
        if spec.scope != scope:
            continue
        candidates = [r for r in matching if key in r.decide]
        if not candidates:
            raise UsageError(f"no rule decides {key} for {target}; add a default rule for it")
        winner = min(candidates, key=lambda r: (-r.priority, r.id))
        decisions[key] = resolve(key, winner)
    return decisions


def _apply(
    override: Override,
    ranks: list[RankPlan],
    world: dict[str, Decision],
    rules: dict[str, Rule],
    warnings: list[Warning_],
    world_size: int,
) -> Override:
    spec = DECISIONS[override.key]
    if spec.scope == "world":
        world[override.key] = _overridden(
            world[override.key], override, spec, rules, warnings, None
        )
        return override
    if override.rank is not None and override.rank >= world_size:
        raise UsageError(
            f"{override.source}: rank {override.rank} does not exist (world size {world_size})"
        )
    targets = [override.rank] if override.rank is not None else list(range(world_size))
    applied_to = []
    for rank in targets:
        current = ranks[rank].decisions[override.key]
        if current.rule in rules and not rules[current.rule].overridable:
            continue  # a physical fact (e.g. no NAX path), not a choice
        ranks[rank].decisions[override.key] = _overridden(
            current, override, spec, rules, warnings, rank
        )
        applied_to.append(rank)
    return override.model_copy(update={"applied_to": applied_to})


def _overridden(
    current: Decision,
    override: Override,
    spec: DecisionSpec,
    rules: dict[str, Rule],
    warnings: list[Warning_],
    rank: int | None,
) -> Decision:
    decided_by = rules.get(current.rule)
    where = "" if rank is None else f" on rank {rank}"
    if decided_by is not None and decided_by.hazard and current.value != override.value:
        warnings.append(
            Warning_(
                rule=decided_by.id,
                message=f"override {spec.key}={override.value}{where} contradicts hazard rule "
                f"{decided_by.id} ({decided_by.title}), which chose {current.value}",
            )
        )
    return Decision(
        value=override.value,
        rule=OVERRIDE_RULE,
        reason=f"operator override ({override.source}); rules chose {current.value} "
        f"by {current.rule}",
    )
