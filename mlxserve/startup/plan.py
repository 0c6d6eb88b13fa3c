"""From settings to a plan: read the inputs, join the cluster, agree, evaluate.

Why this is not in `mlxserve.policy`: the policy evaluates rules over a cluster into a
plan and does nothing else, so it can be read, tested and run anywhere (a simulated
cluster, `policy explain`, a benchmark) without a group, a state directory or a model.
Everything a real start needs around that evaluation is here:

- the rule files and overrides, read and checked before MLX distributed is touched;
- the calibration verdicts in the state directory, and under a launcher every rank's,
  exchanged so that one rank's record covers its twins;
- the incident memory, rank 0's on every rank (its front writes it);
- the model's shape for the tensor-parallel split, from its config and headers;
- the cluster itself (`mlxserve.cluster.discover`), and after evaluating, the check that
  every rank computed the same plan.

`mlxserve.cluster` only moves the bytes; what they mean is decided here.
"""

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxserve.cluster.discover import Membership, discover, launched_world_size
from mlxserve.cluster.exchange import all_gather_bytes, check_same_plan
from mlxserve.config import Settings, state_dir
from mlxserve.errors import UsageError
from mlxserve.policy.calibration import Verdict, merge_verdicts
from mlxserve.policy.calibration_store import load_verdicts
from mlxserve.policy.evaluate import evaluate
from mlxserve.policy.overrides import collect_overrides
from mlxserve.policy.plan import Plan
from mlxserve.policy.rules import load_rules
from mlxserve.policy.split import ModelShape, split_problem
from mlxserve.reliability.incidents import IncidentRecord, IncidentStore

CALIBRATION_BYTES = 16384
"""The exchange buffer for one rank's calibration verdicts."""


def build_plan(settings: Settings) -> tuple[Plan, Membership]:
    # Validate rules and overrides before touching MLX distributed, so bad
    # input fails fast and identically on every rank.
    ruleset = load_rules(settings.policy.rules_dir)
    overrides = collect_overrides(settings.policy.nax_moe, settings.policy.overrides)
    verdicts = load_verdicts(state_dir(settings.server))
    shape = _model_shape(settings)
    membership = discover(settings.cluster)
    if membership.group is None:
        incidents = IncidentStore(state_dir(settings.server)).load()
    else:
        verdicts = _gather_verdicts(membership.group, verdicts)
        incidents = _rank_0s(membership.group, settings)
    plan = evaluate(
        membership.cluster,
        ruleset,
        overrides,
        verdicts,
        incidents=incidents,
        model=shape,
        split=settings.cluster.split,
    )
    if membership.group is not None:
        check_same_plan(membership.group, plan.plan_hash)
    return plan, membership


def _model_shape(settings: Settings) -> ModelShape | None:
    """What the split policy weighs of the model (None: not a local DeepSeek-V4)."""
    from mlxserve.models.loader import model_shape

    numbers = model_shape(settings.model)
    return None if numbers is None else ModelShape(**numbers)


def _gather_verdicts(group: Any, verdicts: list[Verdict]) -> list[Verdict]:
    """Every rank's calibration verdicts, merged (`merge_verdicts`), on every rank."""
    payload = json.dumps([v.model_dump(mode="json") for v in verdicts]).encode()
    if len(payload) > CALIBRATION_BYTES:
        raise UsageError(
            f"this rank's calibration records take {len(payload)} bytes, over the "
            f"{CALIBRATION_BYTES}-byte exchange buffer; remove old ones from the state directory"
        )
    records = all_gather_bytes(group, payload, CALIBRATION_BYTES)
    per_rank = [json.loads(record or b"[]") for record in records]
    return merge_verdicts([[Verdict.model_validate(item) for item in r] for r in per_rank])


def _rank_0s(group: Any, settings: Settings) -> list[IncidentRecord]:
    """Rank 0's incident memory on every rank: its front writes it, and plans must agree."""
    from mlxserve.cluster.broadcast import broadcast_bytes

    payload = None
    if group.rank() == 0:
        incidents = IncidentStore(state_dir(settings.server)).load()
        payload = json.dumps([r.model_dump(mode="json") for r in incidents]).encode()
    received = json.loads(broadcast_bytes(group, payload) or b"[]")
    return [IncidentRecord.model_validate(item) for item in received]


def _uneven_split_unsupported(model: str, split: Sequence[int] | None) -> str | None:
    """Why an uneven ``split`` cannot serve a local checkpoint that says it is not a
    DeepSeek-V4 (only its sharding takes uneven shares), or None. A model known only
    by name is checked when it loads."""
    if split is None or len(set(split)) <= 1:
        return None
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
        model_type = config.get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if model_type in (None, "deepseek_v4"):
        return None
    return f"an uneven split needs a DeepSeek-V4 model; {model} is {model_type!r}"


def check_plan(settings: Settings) -> None:
    """Raise `UsageError` for settings an engine would refuse, before the front listens.

    Why in the front: an engine that exits 2 would only be restarted and fail
    again. Rules and overrides are checked everywhere; the whole plan is built
    when the cluster is known without joining it (simulated, or this machine
    alone); under a launcher, override ranks are checked against its world size.
    """
    ruleset = load_rules(settings.policy.rules_dir)
    overrides = collect_overrides(settings.policy.nax_moe, settings.policy.overrides)
    incidents = IncidentStore(state_dir(settings.server)).load()
    split = settings.cluster.split
    unsupported = _uneven_split_unsupported(settings.model, split)
    if unsupported is not None:
        raise UsageError(f"cluster.split {split}: {unsupported}")
    shape = _model_shape(settings)
    group = settings.cluster.hosts  # a group the front starts: planned once it has joined
    if settings.cluster.simulate or ("MLX_RANK" not in os.environ and not group):
        verdicts = load_verdicts(state_dir(settings.server))
        cluster = discover(settings.cluster).cluster
        plan = evaluate(
            cluster, ruleset, overrides, verdicts, incidents=incidents, model=shape, split=split
        )
        plan.ensure_startable()
        return
    world = len(group) if group else launched_world_size()
    problem = None if split is None or world is None else split_problem(split, world, shape)
    if problem is not None:
        raise UsageError(f"cluster.split {split}: {problem}")
    for override in overrides:
        if world is not None and override.rank is not None and override.rank >= world:
            raise UsageError(
                f"{override.source}: rank {override.rank} does not exist (world size {world})"
            )
