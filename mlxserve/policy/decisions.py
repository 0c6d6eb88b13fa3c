"""The decisions a plan makes: their scope and the values each may take.

Rules and overrides are validated against this registry, so a typo in a rule
file or on the command line is an error, not a silently ignored setting.
"""

from dataclasses import dataclass
from typing import Literal

Scope = Literal["rank", "world"]
Value = str | int | float

FASTEST = "fastest"
"""A rule's value for a calibrated decision: what `mlxserve policy calibrate` measured
fastest on the rank's chip and mlx version (see `mlxserve.policy.calibration`)."""


@dataclass(frozen=True)
class DecisionSpec:
    key: str
    scope: Scope
    description: str
    choices: tuple[str, ...] = ()
    number: type[int] | type[float] | None = None
    minimum: float = 0
    calibrated: bool = False
    """Whether a rule may decide it as `FASTEST`: the variant calibration measured fastest."""

    def coerce(self, raw: object) -> Value:
        """The value `raw` stands for, or ValueError saying what is allowed."""
        if self.choices:
            if isinstance(raw, str) and raw in self.choices:
                return raw
            raise ValueError(f"{self.key} must be one of {', '.join(self.choices)}, not {raw!r}")
        assert self.number is not None
        try:
            if isinstance(raw, bool) or not isinstance(raw, int | float | str):
                raise TypeError
            value = self.number(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{self.key} must be a {self.number.__name__}, not {raw!r}") from None
        if self.number is int and isinstance(raw, float) and raw != value:
            raise ValueError(f"{self.key} must be a whole number, not {raw!r}")
        if value < self.minimum:
            raise ValueError(f"{self.key} must be >= {self.minimum:g}, not {raw!r}")
        return value


DECISIONS: dict[str, DecisionSpec] = {
    spec.key: spec
    for spec in (
        DecisionSpec(
            "nax_moe",
            "rank",
            "Quantized MoE kernel on this rank: skip (mlx-lm's stock sorted gather_qmm; on NAX "
            "with mlx >= 0.32.2 that kernel skips inactive simdgroups, mlx#4352), full "
            "(mlxserve's expert-aligned tiles: never dispatch the sorted gather), off (no NAX "
            "path: the stock call, as mlx-lm builds the model).",
            choices=("skip", "full", "off"),
            calibrated=True,
        ),
        DecisionSpec(
            "moe_rows_per_expert_min",
            "rank",
            "Smallest rows per expert (prefill step x top_k / experts) a prefill chunk should "
            "give the MoE kernel; 0 for no floor. The engine raises its prefill step to meet it.",
            number=int,
        ),
        DecisionSpec(
            "startup",
            "world",
            "Whether the cluster may start serving: allow or refuse.",
            choices=("allow", "refuse"),
        ),
        DecisionSpec(
            "progress_timeout_s",
            "world",
            "Seconds a step may make no progress before the watchdog ends the engine (exit 75).",
            number=float,
            minimum=0.001,
        ),
    )
}


def decision_spec(key: str) -> DecisionSpec:
    try:
        return DECISIONS[key]
    except KeyError:
        raise ValueError(f"unknown decision {key!r}; known: {', '.join(DECISIONS)}") from None
