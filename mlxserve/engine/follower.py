"""A follower rank of a tensor-parallel group: `mlxserve serve` on a rank other than 0.

Rank 0's `mlxserve serve` runs the HTTP front and an engine process that leads;
every other rank (started by `mlx.launch` with the same command and config) runs
this: it joins the group, computes the same plan, loads its shard of the model,
and runs the steps rank 0 broadcasts (`lockstep.follow`) until rank 0 stops.
"""

import logging

from mlxserve.config import Settings
from mlxserve.errors import UsageError

log = logging.getLogger(__name__)


def run_follower(settings: Settings) -> int:
    from mlxserve.engine.build import build_engine
    from mlxserve.engine.lockstep import Diverged, follow
    from mlxserve.engine.process import configure_logging
    from mlxserve.policy.build import build_plan

    configure_logging()
    plan, membership = build_plan(settings)
    plan.ensure_startable()
    group = membership.group
    if group is None or membership.rank == 0:
        raise UsageError("a follower runs on a rank other than 0 of a distributed group")
    engine, _ = build_engine(settings, plan, membership.rank, group)
    log.info(
        "rank %d of %d: plan %s; following rank 0",
        membership.rank,
        group.size(),
        plan.plan_hash[:12],
    )
    try:
        steps = follow(engine, group)
    except Diverged as exc:
        log.error("%s; stopping", exc)
        return 1
    log.info("rank %d: rank 0 stopped after %d steps; exiting", membership.rank, steps)
    return 0
