"""The plan: every decision per rank and for the world, with the rule behind it.

The plan is what the rest of mlxserve reads; nothing outside `policy/`,
`hardware/` and `kernels/` looks at chips. Its hash is computed over the
canonical JSON of its content, so ranks can check they agree.
"""

import hashlib
import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mlxserve.errors import UsageError
from mlxserve.hardware.composition import Composition
from mlxserve.policy.decisions import Value
from mlxserve.policy.split import SplitDecision

OVERRIDE_RULE = "override"


class Decision(BaseModel):
    model_config = ConfigDict(frozen=True)

    value: Value
    rule: str
    reason: str


class RankPlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    rank: int
    profile: dict[str, Any]
    decisions: dict[str, Decision]


class Override(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str
    rank: int | None
    value: Value
    source: str
    applied_to: list[int] | None = None


class Warning_(BaseModel):
    model_config = ConfigDict(frozen=True)

    rule: str
    message: str


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True)

    schema_version: int = 1
    plan_hash: str = ""
    simulated: bool
    world_size: int
    backend: str
    wires: int
    composition: Composition
    ranks: list[RankPlan]
    world: dict[str, Decision]
    overrides: list[Override] = Field(default_factory=list)
    warnings: list[Warning_] = Field(default_factory=list)
    rule_files: list[str] = Field(default_factory=list)
    split: SplitDecision | None = None
    """The tensor-parallel split (``policy.split``); None only in plans built by hand."""

    def with_hash(self) -> "Plan":
        content = self.model_dump(mode="json", exclude={"plan_hash"})
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return self.model_copy(update={"plan_hash": hashlib.sha256(canonical.encode()).hexdigest()})

    def document(self) -> dict[str, Any]:
        """The stable machine-readable form (`policy explain --json`, `GET /v1/policy`)."""
        return self.model_dump(mode="json")

    # What the rest of the code asks. Ranks count from 0.

    def rank_value(self, rank: int, key: str) -> Value:
        return self.ranks[rank].decisions[key].value

    def world_value(self, key: str) -> Value:
        return self.world[key].value

    def tensor_split(self) -> list[int]:
        """Each rank's share of the sharded weights, in parts (even when not decided)."""
        return list(self.split.shares) if self.split is not None else [1] * self.world_size

    def nax_moe(self, rank: int) -> str:
        return str(self.rank_value(rank, "nax_moe"))

    def progress_timeout_s(self) -> float:
        return float(self.world_value("progress_timeout_s"))

    def prefill_step_size(self, configured: int, num_experts: int, top_k: int) -> int:
        """The prefill chunk every rank uses: `configured`, raised to meet every rank's floor.

        Ranks run in lockstep, so the largest floor wins. A raised step is
        rounded up to a multiple of 256 to keep chunk shapes few.
        """
        floor = max(int(self.rank_value(r.rank, "moe_rows_per_expert_min")) for r in self.ranks)
        if floor == 0 or num_experts <= 0 or top_k <= 0:
            return configured
        needed = math.ceil(floor * num_experts / top_k)
        return max(configured, 256 * math.ceil(needed / 256))

    def ensure_startable(self) -> None:
        """Raise `UsageError` naming the rule when the plan refuses to start."""
        decision = self.world["startup"]
        if decision.value == "refuse":
            raise UsageError(
                f"refusing to start (rule {decision.rule}): {decision.reason}; "
                "override with --policy startup=allow if you accept the risk"
            )
