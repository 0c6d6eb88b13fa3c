"""Rule files: schema, validation and loading.

A rule says when it applies (conditions on the cluster and the rank) and what
it decides, with the upstream references that justify it. Rules are data in
`policies/*.toml`, one file per hazard or concern, so a new hazard is a new
file, not new code.
"""

import tomllib
from pathlib import Path
from typing import Any, Literal

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mlxserve.errors import UsageError
from mlxserve.hardware.composition import Composition
from mlxserve.policy.decisions import FASTEST, Scope, Value, decision_spec

#: What an incident rule's reason may name.
INCIDENT_FIELDS = {"incident_at": "", "incident_plan": "", "incident_kind": "", "incident_step": ""}


class Conditions(BaseModel):
    """All given conditions must hold; an absent condition always holds.

    For a rank rule, `rank_nax`, `chips`, `device` and `mlx` look at the rank
    being decided; for a world rule, `chips`, `device` and `mlx` hold when any
    rank matches. `device` is where MLX computes (metal, cuda, cpu); `backend`
    is the distributed backend between ranks.
    Numeric and version conditions are specifiers such as ">=2" or "<0.32.1".
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    composition: list[Composition] | None = None
    rank_nax: bool | None = None
    world_size: str | None = None
    mlx: str | None = None
    backend: list[Literal["none", "ring", "jaccl", "mpi", "nccl"]] | None = None
    chips: list[str] | None = None
    device: list[Literal["metal", "cuda", "cpu"]] | None = None
    wires: str | None = None
    #: True: holds when the incident memory has a hang or watchdog exit of this kind of
    #: cluster (same composition and chips). The rule's reason may then name it with
    #: {incident_at}, {incident_plan}, {incident_kind} and {incident_step}.
    incident: bool | None = None

    @field_validator("world_size", "mlx", "wires")
    @classmethod
    def _specifier(cls, text: str | None) -> str | None:
        if text is not None:
            try:
                SpecifierSet(text)
            except InvalidSpecifier:
                raise ValueError(f"not a version range like '>=0.32.2': {text!r}") from None
        return text


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    title: str
    references: list[str] = Field(default_factory=list)
    priority: int
    scope: Scope
    hazard: bool = False
    overridable: bool = True
    when: Conditions = Field(default_factory=Conditions)
    decide: dict[str, Value] = Field(default_factory=dict)
    reason: str
    warn: str | None = None

    @model_validator(mode="after")
    def _decisions_fit(self) -> "Rule":
        if not self.decide and self.warn is None:
            raise ValueError("a rule must decide something or warn")
        for key, raw in self.decide.items():
            spec = decision_spec(key)
            if spec.scope != self.scope:
                raise ValueError(f"decision {key!r} is {spec.scope}-scoped, rule is {self.scope}")
            if raw == FASTEST:
                if not spec.calibrated:
                    raise ValueError(f"{key} is not calibrated; it cannot be {FASTEST!r}")
                if self.hazard:
                    raise ValueError(f"a hazard rule cannot decide {key} by speed ({FASTEST!r})")
                continue
            spec.coerce(raw)
        if self.scope == "world" and self.when.rank_nax is not None:
            raise ValueError("rank_nax is a rank condition; a world rule cannot use it")
        if "{" in self.reason and not self.when.incident:
            raise ValueError("only a rule with when.incident = true may use {placeholders}")
        if self.when.incident:
            try:
                self.reason.format(**INCIDENT_FIELDS)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"reason: unknown placeholder {exc}") from None
        return self

    def decided(self, key: str) -> Value:
        return decision_spec(key).coerce(self.decide[key])

    @property
    def speed(self) -> bool:
        """A speed rule decides by calibration; it matches only calibrated ranks."""
        return FASTEST in self.decide.values()


class RuleSet(BaseModel):
    """Rules loaded from a directory, with the files they came from."""

    model_config = ConfigDict(frozen=True)

    rules: list[Rule]
    sources: list[str]


def builtin_rules_dir() -> Path:
    """The shipped rules: inside the wheel, or the repo's `policies/` when run from source."""
    packaged = Path(__file__).resolve().parents[1] / "_policies"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "policies"


def load_rules(directory: Path | None = None) -> RuleSet:
    """Every `*.toml` rule file in `directory`, validated. Errors name file and field."""
    directory = directory or builtin_rules_dir()
    if not directory.is_dir():
        raise UsageError(f"{directory}: rules directory not found")
    files = sorted(directory.glob("*.toml"))
    if not files:
        raise UsageError(f"{directory}: no rule files (*.toml)")
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for path in files:
        for rule in _load_file(path):
            if rule.id in seen:
                raise UsageError(
                    f"{path.name}: rule id {rule.id!r} already defined in {seen[rule.id]}"
                )
            seen[rule.id] = path.name
            rules.append(rule)
    _check_speed_below_hazards(rules, seen)
    return RuleSet(rules=rules, sources=[path.name for path in files])


def _check_speed_below_hazards(rules: list[Rule], files: dict[str, str]) -> None:
    """A measurement may choose among safe variants only: hazards must outrank it."""
    for speed in (r for r in rules if r.speed):
        for hazard in (r for r in rules if r.hazard and r.scope == speed.scope):
            shared = sorted(set(speed.decide) & set(hazard.decide))
            if shared and hazard.priority <= speed.priority:
                raise UsageError(
                    f"{files[speed.id]}: speed rule {speed.id} (priority {speed.priority}) "
                    f"must rank below hazard rule {hazard.id} (priority {hazard.priority}, "
                    f"{files[hazard.id]}), which also decides {shared[0]}"
                )


def _load_file(path: Path) -> list[Rule]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"rule"})
    if unknown:
        raise UsageError(f"{path}: unknown top-level key '{unknown[0]}' (rules go in [[rule]])")
    entries: Any = data.get("rule")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{path}: no [[rule]] tables")
    rules = []
    for index, entry in enumerate(entries):
        try:
            rules.append(Rule.model_validate(entry))
        except ValidationError as exc:
            error = exc.errors()[0]
            field = ".".join(str(part) for part in error["loc"]) or "rule"
            name = entry.get("id", f"#{index + 1}") if isinstance(entry, dict) else f"#{index + 1}"
            message = str(error["msg"]).removeprefix("Value error, ")
            if error["type"] == "extra_forbidden":
                message = "unknown field"
            raise UsageError(f"{path}: rule {name}: field '{field}': {message}") from None
    return rules
