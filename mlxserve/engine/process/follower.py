"""A follower rank of a tensor-parallel group: `mlxserve serve` on a rank other than 0.

Rank 0's `mlxserve serve` runs the HTTP front and an engine process that leads;
every other rank (started by `mlx.launch` with the same command and config) runs
this: it joins the group, computes the same plan, loads its shard of the model,
and runs the steps rank 0 broadcasts (`lockstep.follow`) until rank 0 stops.
Like rank 0's engine it runs the progress watchdog: a step that never finishes
(a collective whose peer is gone) ends the rank with exit 75, and a step that raises
(a collective that broke) ends it with exit 1, never back to waiting on the group.
"""

import logging

from mlxserve.cluster.signals import SignalCounter
from mlxserve.config import Settings
from mlxserve.errors import UsageError

log = logging.getLogger(__name__)


def _waiting_for_rank_0(signum: int) -> None:
    log.info("signal %d: waiting for rank 0 to stop (again to exit now)", signum)


def run_follower(settings: Settings) -> int:
    from mlxserve.engine.core.build import build_engine
    from mlxserve.engine.process.lockstep import Diverged, follow
    from mlxserve.engine.process.loop import configure_logging
    from mlxserve.engine.process.warmup import WARM_UP_STEP_S
    from mlxserve.reliability.faults import FaultInjector, Faults, active_faults
    from mlxserve.reliability.watchdog import Watchdog
    from mlxserve.startup.plan import build_plan

    configure_logging()
    # `mlx.launch` forwards Ctrl-C to every rank: rank 0 then drains and broadcasts
    # stop, so the first signal here only waits for that; a second one exits at once
    # (a rank 0 that is gone can send nothing).
    SignalCounter(2, on_wait=_waiting_for_rank_0).install()
    try:  # read here, at rank start: a test's follower-only stall (never in production)
        hang_at = active_faults().follower_hang_at_step
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    plan, membership = build_plan(settings)
    plan.ensure_startable()
    group = membership.group
    if group is None or membership.rank == 0:
        raise UsageError("a follower runs on a rank other than 0 of a distributed group")
    engine, _ = build_engine(settings, plan, membership.rank, group)
    engine.follows_group = True  # a step that raises ends this rank (`Engine._run`)
    if hang_at is not None:
        log.warning("FAULT INJECTION ARMED (tests only): this follower hangs at step %d", hang_at)
        engine.before_step = FaultInjector(Faults(hang_at_step=hang_at))
    log.info(
        "rank %d of %d: plan %s; following rank 0",
        membership.rank,
        group.size(),
        plan.plan_hash[:12],
    )
    # Every rank watches its own steps: a collective that never completes here
    # (a peer gone or wedged) ends this rank with exit 75, as on rank 0.
    # Rank 0's warm-up steps (`mlxserve.engine.process.warmup`) are allowed longer.
    watchdog = Watchdog(engine, plan.progress_timeout_s(), warm_up_timeout_s=WARM_UP_STEP_S)
    watchdog.start()
    try:
        steps = follow(engine, group)
    except Diverged as exc:
        log.error("%s; stopping", exc)
        return 1
    except Exception as exc:  # a step that raised: the group is broken (a peer lost)
        log.error("rank %d: a step failed (%s); the group is broken, exiting", membership.rank, exc)
        return 1
    finally:
        watchdog.stop()
    log.info("rank %d: rank 0 stopped after %d steps; exiting", membership.rank, steps)
    return 0
