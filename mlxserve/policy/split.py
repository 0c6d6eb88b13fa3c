"""The tensor-parallel split: each rank's share of the sharded weights, from the cluster.

A decode step is bound by memory bandwidth: each rank reads the weights it uses once
per step, and the ranks wait for each other at every ``all_sum``. So a rank's step time
is estimated as the bytes it reads over its bandwidth, the sharded part weighted by
the cost of the MoE variant it runs (``full`` on a NAX rank computes every simdgroup),
and the split that makes the slowest rank fastest wins, among those whose shard fits
every rank's memory (with `WEIGHT_SHARE` headroom). Weights are cut into ``parts``
equal parts (a count the model's output groups and quantisation groups allow, see
``ModelShape``); rank ``r`` takes ``shares[r]`` of them
(``mlxserve.models.deepseek_v4.sharding``).

The even split stays unless the best uneven one is estimated `MIN_GAIN` faster, the
even one does not fit, or the ranks cannot cut the model evenly (8 output groups over 3
ranks): estimates are rough, and an even split is what every homogeneous cluster gets.
An operator's ``[cluster] split`` replaces the choice (validated here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from mlxserve.errors import UsageError
from mlxserve.hardware.catalog import memory_bandwidth_gbs
from mlxserve.hardware.composition import Cluster
from mlxserve.hardware.profile import RankProfile
from mlxserve.policy.calibration import Verdict, verdict_for

FULL_COST = 1.07
"""Relative time of the sharded (expert) work on a rank running ``full`` when no
calibration of its chip measured it: the upper end of the 2-7% that skipping inactive
simdgroups (mlx#4352) saves on M5."""

MIN_GAIN = 1.05
"""An uneven split replaces the even one only when its slowest rank is estimated this
much faster, so a rough estimate never moves a cluster that is nearly balanced."""

METAL_USABLE = 0.75
"""Fraction of a Mac's unified memory the GPU may fill (the recommended working set
without ``iogpu.wired_limit_mb``), as ``hardware.probe.usable_memory_bytes`` reads it."""

WEIGHT_SHARE = 0.9
"""Most of a rank's usable memory a proposed split fills with weights: the rest is left
for the KV cache, activations and the system (the loader itself only refuses weights
beyond the usable memory)."""

MAX_PARTS = 64
"""Most parts considered (one part is then under 2% of the sharded weights), which keeps
the search small."""

SPLIT_RULE = "split-balance"
EVEN_RULE = "split-even"
OVERRIDE_RULE = "split-override"


class ModelShape(BaseModel):
    """What the split needs to know of a model, from its config and headers (no weights).

    ``granularity``: the largest number of equal parts every sharded tensor can be cut
    into (whole output groups, whole quantisation groups); any divisor of it works too.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    granularity: int
    replicated_bytes: int
    sharded_bytes: int
    replicated_read: int
    """Bytes of the replicated weights a decode step reads (not the embedding table)."""
    sharded_read: int
    """Bytes of the sharded weights a decode step reads (routed experts: top-k of them)."""


class RankEstimate(BaseModel):
    """One rank under the chosen split: what it holds, reads and is estimated to take."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int
    share: int
    held_bytes: int
    usable_bytes: int
    bandwidth_gbs: float | None
    cost: float
    step_ms: float | None


class SplitDecision(BaseModel):
    """The plan's split and why; ``estimates`` is empty when the model is not known."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shares: list[int]
    rule: str
    reason: str
    estimates: list[RankEstimate] = []

    @property
    def parts(self) -> int:
        return sum(self.shares)

    def text(self) -> str:
        """``3+1 of 4 parts``: how the explain output names it."""
        return "+".join(str(s) for s in self.shares) + f" of {self.parts} parts"


def usable_bytes(profile: RankProfile) -> int:
    """Memory the rank's weights may fill."""
    if profile.device_type == "metal":
        return int(profile.memory_bytes * METAL_USABLE)
    return profile.memory_bytes


def full_cost(profile: RankProfile, variant: str, verdicts: Sequence[Verdict]) -> float:
    """How much longer this rank's sharded work takes for its MoE variant.

    Only ``full`` costs more. A calibration of the rank's chip that measured ``full``
    against the stock call gives the ratio; one that chose ``full`` as fastest means no
    cost; without one, `FULL_COST`.
    """
    if variant != "full":
        return 1.0
    verdict, _ = verdict_for(profile.chip, profile.device_type, profile.mlx_version, verdicts)
    if verdict is None or verdict.ratio is None:
        return FULL_COST
    if verdict.variant == "full":
        return 1.0
    if verdict.baseline == "full":
        return max(verdict.ratio, 1.0)
    return FULL_COST


def _parts_choices(granularity: int, ranks: int) -> list[int]:
    return [p for p in range(ranks, min(granularity, MAX_PARTS) + 1) if granularity % p == 0]


class _Costs:
    """Per-rank step time and memory of a share, for one model and cluster."""

    def __init__(
        self, shape: ModelShape, cluster: Cluster, costs: list[float], known_bandwidth: bool
    ) -> None:
        self.shape = shape
        self.costs = costs
        self.usable = [usable_bytes(p) for p in cluster.ranks]
        bandwidths = [memory_bandwidth_gbs(p.chip) for p in cluster.ranks]
        self.bandwidths = bandwidths
        self.known = known_bandwidth
        # Unknown bandwidth anywhere: compare ranks as equals (times in "bytes at 1 GB/s").
        self.gbs = [(b or 1.0) if known_bandwidth else 1.0 for b in bandwidths]

    def held(self, rank: int, share: int, parts: int) -> int:
        return self.shape.replicated_bytes + math.ceil(self.shape.sharded_bytes * share / parts)

    def fits(self, rank: int, share: int, parts: int) -> bool:
        limit = self.usable[rank] * WEIGHT_SHARE
        return self.usable[rank] <= 0 or self.held(rank, share, parts) <= limit

    def step_ms(self, rank: int, share: int, parts: int) -> float:
        sharded = self.shape.sharded_read * share / parts * self.costs[rank]
        read = self.shape.replicated_read + sharded
        return read / (self.gbs[rank] * 1e9) * 1e3

    def slowest(self, shares: Sequence[int]) -> float:
        parts = sum(shares)
        return max(self.step_ms(r, s, parts) for r, s in enumerate(shares))

    def all_fit(self, shares: Sequence[int]) -> bool:
        parts = sum(shares)
        return all(self.fits(r, s, parts) for r, s in enumerate(shares))


def _balanced(costs: _Costs, ranks: int, parts: int) -> list[int] | None:
    """The shares of ``parts`` whose slowest rank is fastest, every shard fitting; None
    when no split into ``parts`` fits. Greedy: each part goes where the resulting step
    is shortest, which is optimal for step times that grow with the share."""
    shares = [1] * ranks
    if not all(costs.fits(r, 1, parts) for r in range(ranks)):
        return None
    for _ in range(parts - ranks):
        options = [
            (costs.step_ms(r, shares[r] + 1, parts), r)
            for r in range(ranks)
            if costs.fits(r, shares[r] + 1, parts)
        ]
        if not options:
            return None
        shares[min(options)[1]] += 1
    return shares


def _estimates(costs: _Costs, shares: Sequence[int]) -> list[RankEstimate]:
    parts = sum(shares)
    return [
        RankEstimate(
            rank=rank,
            share=share,
            held_bytes=costs.held(rank, share, parts),
            usable_bytes=costs.usable[rank],
            bandwidth_gbs=costs.bandwidths[rank],
            cost=round(costs.costs[rank], 3),
            step_ms=round(costs.step_ms(rank, share, parts), 3) if costs.known else None,
        )
        for rank, share in enumerate(shares)
    ]


def _gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def decide_split(
    cluster: Cluster,
    variants: Sequence[str],
    shape: ModelShape | None,
    verdicts: Sequence[Verdict] = (),
    override: Sequence[int] | None = None,
) -> SplitDecision:
    """The plan's split: ``override`` (the operator's ``[cluster] split``, validated:
    ``UsageError`` naming the problem) or the policy's proposal. ``variants``: each
    rank's MoE variant from the plan; ``verdicts``: the calibrations it read."""
    proposed = propose_split(cluster, variants, shape, verdicts)
    if override is None:
        return proposed
    problem = split_problem(override, cluster.world_size, shape)
    if problem is not None:
        raise UsageError(f"cluster.split {list(override)}: {problem}")
    estimates: list[RankEstimate] = []
    if shape is not None:
        estimates = _estimates(_costs(cluster, variants, shape, verdicts), override)
    return SplitDecision(
        shares=list(override),
        rule=OVERRIDE_RULE,
        reason=f"operator override (cluster.split); the policy chose {proposed.text()} "
        f"by {proposed.rule}",
        estimates=estimates,
    )


def _costs(
    cluster: Cluster, variants: Sequence[str], shape: ModelShape, verdicts: Sequence[Verdict]
) -> _Costs:
    known = all(memory_bandwidth_gbs(p.chip) is not None for p in cluster.ranks)
    factors = [full_cost(p, v, verdicts) for p, v in zip(cluster.ranks, variants, strict=True)]
    return _Costs(shape, cluster, factors, known)


def _names(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def propose_split(
    cluster: Cluster,
    variants: Sequence[str],
    shape: ModelShape | None,
    verdicts: Sequence[Verdict] = (),
) -> SplitDecision:
    """The policy's split for ``cluster`` (see the module docstring)."""
    ranks = cluster.world_size
    even = [1] * ranks
    if ranks == 1:
        return SplitDecision(shares=even, rule=EVEN_RULE, reason="one rank: nothing to split")
    if shape is None:
        return SplitDecision(
            shares=even,
            rule=EVEN_RULE,
            reason="the model's sizes are not known before it loads (not a local "
            "DeepSeek-V4 directory): even split",
        )
    costs = _costs(cluster, variants, shape, verdicts)
    choices = _parts_choices(shape.granularity, ranks)
    candidates = [s for p in choices if (s := _balanced(costs, ranks, p)) is not None]
    best = min(candidates, key=lambda s: (costs.slowest(s), sum(s)), default=None)
    equal = (
        "" if costs.known else "; some rank's bandwidth is unknown, so ranks count as equally fast"
    )
    short = [r for r in range(ranks) if not costs.fits(r, 1, ranks)]
    cuttable = shape.granularity % ranks == 0
    if not choices:
        return SplitDecision(
            shares=even,
            rule=EVEN_RULE,
            reason=f"the model cuts into at most {shape.granularity} parts, fewer than "
            f"{ranks} ranks: even split, which the loader will refuse",
        )
    if best is None:
        return SplitDecision(
            shares=even,
            rule=EVEN_RULE,
            reason=f"no split fits every rank's memory (rank {_names(short)} short even with "
            "its smallest share): even split, which the loader will refuse",
            estimates=_estimates(costs, even),
        )
    gain = costs.slowest(even) / costs.slowest(best)
    if cuttable and not short and (gain < MIN_GAIN or best == even):
        return SplitDecision(
            shares=even,
            rule=EVEN_RULE,
            reason=f"the best uneven split would make the slowest rank's decode step "
            f"{gain:.2f}x faster, under the {MIN_GAIN:.2f}x that moves off the even "
            f"split{equal}",
            estimates=_estimates(costs, even),
        )
    if not cuttable:
        why = f"{ranks} ranks cannot split the model's {shape.granularity} parts evenly"
    elif short:
        why = f"the even split does not fit rank {_names(short)}"
    else:
        why = f"the slowest rank's decode step is estimated {gain:.2f}x faster than even"
    inputs = "; ".join(
        f"rank {r}: {_gib(costs.usable[r])} usable, "
        + (f"{costs.bandwidths[r]:g} GB/s" if costs.bandwidths[r] else "bandwidth unknown")
        + (f", MoE x{costs.costs[r]:.2f} ({variants[r]})" if costs.costs[r] != 1.0 else "")
        for r in range(ranks)
    )
    return SplitDecision(
        shares=best,
        rule=SPLIT_RULE,
        reason=f"{why} ({inputs}){equal}",
        estimates=_estimates(costs, best),
    )


def split_problem(shares: Sequence[int], ranks: int, shape: ModelShape | None) -> str | None:
    """Why ``shares`` cannot split a model of ``shape`` over ``ranks``, or None."""
    if len(shares) != ranks:
        return f"{len(shares)} shares for {ranks} ranks (one share per rank)"
    if any(s < 1 for s in shares):
        return f"shares must be >= 1, got {list(shares)}"
    if shape is not None and shape.granularity % sum(shares):
        return (
            f"{sum(shares)} parts do not divide the model's {shape.granularity} (the "
            "largest count its output groups and quantisation groups can be cut into)"
        )
    return None
