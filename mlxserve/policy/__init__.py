"""The kernel-policy engine: rules as data, evaluated into a per-rank plan."""

from mlxserve.policy.plan import Decision, Plan

__all__ = ["Decision", "Plan"]
