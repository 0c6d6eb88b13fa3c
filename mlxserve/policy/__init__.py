"""The kernel-policy engine: rules as data, evaluated into a per-rank plan.

Pure: it evaluates rules over a cluster (`policy.evaluate`) and returns a plan. It joins
no group and loads no model; building a plan at startup, with the exchanges between
ranks, is `mlxserve.startup.plan`.
"""

from mlxserve.policy.plan import Decision, Plan

__all__ = ["Decision", "Plan"]
