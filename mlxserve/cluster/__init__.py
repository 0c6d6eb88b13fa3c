"""The set of ranks that serve together: joining them and moving bytes between them.

Nothing here decides anything: the plan is built by `mlxserve.startup.plan` from what
these modules gather, and evaluated by `mlxserve.policy`.
"""
