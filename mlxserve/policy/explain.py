"""Render a plan for people: one row per rank, then the world, overrides, warnings."""

from mlxserve.policy.decisions import DECISIONS
from mlxserve.policy.plan import OVERRIDE_RULE, Plan


def explain_text(plan: Plan) -> str:
    kind = "simulated cluster" if plan.simulated else "cluster"
    lines = [
        f"policy plan {plan.plan_hash[:12]}  ({kind}: {plan.world_size} rank(s), "
        f"backend {plan.backend}, {plan.composition.replace('_', ' ')})",
        "",
    ]
    rank_keys = [k for k, spec in DECISIONS.items() if spec.scope == "rank"]
    header = ["rank", "chip", "NAX", "mlx", *rank_keys]
    rows = [header]
    for rank in plan.ranks:
        profile = rank.profile
        chip = str(profile["chip"]) + (" (simulated)" if profile.get("simulated") else "")
        cells = [
            str(rank.rank),
            chip,
            "yes" if profile["nax"] else "no",
            str(profile["mlx_version"]),
        ]
        cells += [f"{rank.decisions[k].value} [{rank.decisions[k].rule}]" for k in rank_keys]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.append("")
    for key, decision in plan.world.items():
        lines.append(f"{key}: {decision.value} [{decision.rule}]")
    lines += _split_lines(plan)
    lines.append("")
    lines.append("why:")
    # rule -> reason -> ranks: a speed rule's reason (measured ratio) differs per chip.
    reasons: dict[str, dict[str, list[int]]] = {}
    for rank in plan.ranks:
        for d in rank.decisions.values():
            reasons.setdefault(d.rule, {}).setdefault(d.reason, []).append(rank.rank)
    for d in plan.world.values():
        reasons.setdefault(d.rule, {}).setdefault(d.reason, [])
    if plan.split is not None and plan.world_size > 1:
        reasons.setdefault(plan.split.rule, {}).setdefault(plan.split.reason, [])
    reasons.pop(OVERRIDE_RULE, None)
    for rule, by_reason in sorted(reasons.items()):
        if len(by_reason) == 1:
            lines.append(f"  {rule}: {next(iter(by_reason))}")
            continue
        for reason, ranks in by_reason.items():
            where = ", ".join(str(r) for r in sorted(set(ranks)))
            lines.append(f"  {rule} (rank {where}): {reason}")
    for override in plan.overrides:
        if override.applied_to is None:
            target = "the cluster"
        elif override.applied_to:
            target = "rank(s) " + ", ".join(str(r) for r in override.applied_to)
        else:
            target = "no rank (the targeted decisions are not overridable)"
        lines.append(f"override: {override.key}={override.value} on {target} ({override.source})")
    lines += [f"WARNING [{w.rule}]: {w.message}" for w in plan.warnings]
    return "\n".join(lines)


def _split_lines(plan: Plan) -> list[str]:
    """The tensor-parallel split and, when the model is known, what each rank holds."""
    split = plan.split
    if split is None or plan.world_size == 1:
        return []
    lines = [f"tensor_split: {split.text()} [{split.rule}]"]
    for rank in split.estimates:
        held = f"holds {_size(rank.held_bytes)} of {_size(rank.usable_bytes)}"
        speed = f"{rank.bandwidth_gbs:g} GB/s" if rank.bandwidth_gbs else "bandwidth unknown"
        step = f", ~{rank.step_ms:.3g} ms a decode step" if rank.step_ms is not None else ""
        lines.append(f"  rank {rank.rank}: {rank.share} part(s), {held}, {speed}{step}")
    return lines


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"
