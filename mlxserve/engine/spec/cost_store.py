"""The automatic depth's calibration, kept across runs in the state directory.

Why: measuring what a speculative round costs (`mlxserve.engine.spec.costs`) takes
about a hundred plain steps: 0.5-2 s of every `mlxserve generate --speculative-depth
auto` on a 2-core CPU, and the first request a server answered (about 8 s on a
2-rank ring). The figures depend only on what runs the rounds: the device, the
mlx and mlx-lm versions, the model (its config and weights), the plan's kernel
choices, the engine's tuning, the deepest draft, the group's size and the clock that
timed them. A record kept under a `CostsKey` of all of these is as good as a fresh
measurement on a later run, so the engine measures once per key and reads the
record after (`Engine._calibrate`).

One JSON file per key, written whole or not at all the way calibration records are
(`mlxserve.policy.calibration_store.write_atomically`). A file that cannot be read
or parsed, or whose key is not the one asked for, is ignored with one warning: the
engine measures again and replaces it. A store that cannot be written costs a
warning, never a step.

Beside each record, under the same key, the acceptance the automatic depth saw
(`StoredAcceptance`): without it every run starts from a neutral guess, and on a
25-token `generate` of a prompt whose drafts are seldom kept the guess alone paid
for two to four depth-1 rounds (5-10 % over depth 0 on this CPU, stop 33).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mlxserve.engine.spec.costs import MEASUREMENT, RoundCosts
from mlxserve.policy.calibration_store import write_atomically

log = logging.getLogger(__name__)

#: Under the state directory, next to `mlxserve policy calibrate`'s records (whose
#: directory is read as a whole, so these stay out of it).
SUBDIR = "round_costs"


class CostsKey(BaseModel):
    """Everything a round-cost measurement depends on: a stored one is reused only
    when every field matches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_type: str
    chip: str
    mlx_version: str
    mlx_lm_version: str
    #: `model_fingerprint`: the model's source, config, and weights' names and shapes.
    model: str
    #: This rank's and the world's decisions (kernel variants), as a digest.
    plan: str
    #: The engine's tuning knobs (`EngineTuning`), as a digest.
    tuning: str
    #: The deepest draft the engine times.
    max_depth: int
    #: Ranks in the tensor-parallel group (their collectives are in every round).
    world_size: int
    #: "process" (CPU time, on a CPU device) or "wall".
    clock: str
    #: `costs.MEASUREMENT`: how the probes run; a change invalidates older records.
    measurement: int = MEASUREMENT

    def digest(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:20]


class StoredCosts(BaseModel):
    """One measurement, as kept on disk."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    created_at: str
    key: CostsKey
    plain: float = Field(gt=0)
    rounds: dict[int, float] = Field(default_factory=dict)
    verify: dict[int, float] = Field(default_factory=dict)
    draft: float = Field(0.0, ge=0)

    def costs(self) -> RoundCosts:
        return RoundCosts(
            plain=self.plain, verify=dict(self.verify), draft=self.draft, rounds=dict(self.rounds)
        )


class StoredAcceptance(BaseModel):
    """The draft positions' counts over earlier runs' requests: per position j, the
    rounds that reached it (every draft before it kept) and those that kept it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    created_at: str
    key: CostsKey
    reached: list[int] = Field(max_length=64)
    accepted: list[int] = Field(max_length=64)

    @model_validator(mode="after")
    def _counts_agree(self) -> StoredAcceptance:
        pairs = zip(self.reached, self.accepted, strict=False)
        if len(self.reached) != len(self.accepted) or any(not 0 <= a <= r for r, a in pairs):
            raise ValueError("accepted must pair with reached, 0 <= accepted <= reached")
        return self


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """The part of a `CostsKey` fixed before an engine is built (`run_identity`)."""

    device_type: str
    chip: str
    mlx_version: str
    mlx_lm_version: str
    model: str
    plan: str


@dataclasses.dataclass(frozen=True)
class CostsPlace:
    """Where an engine keeps its measured round costs, and what it runs apart from
    itself: the state directory, the run's identity (`run_identity`) and the group's
    size. The engine adds its own part of the key (tuning, depth, clock: `CostsKey`)."""

    state_dir: Path
    identity: RunIdentity
    world_size: int = 1

    def key(self, tuning: Any, max_depth: int, clock: str) -> CostsKey:
        return CostsKey(
            **dataclasses.asdict(self.identity),
            tuning=digest(tuning),
            max_depth=max_depth,
            world_size=self.world_size,
            clock=clock,
        )


def costs_path(state_dir: Path, key: CostsKey) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", key.device_type.lower()).strip("-") or "device"
    return state_dir / SUBDIR / f"{slug}-{key.digest()}.json"


def load_costs(state_dir: Path, key: CostsKey) -> RoundCosts | None:
    """The costs stored under ``key``, or None (none stored; one bad file: a warning)."""
    path = costs_path(state_dir, key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("round costs %s unreadable (%s); measuring again", path, exc)
        return None
    try:
        stored = StoredCosts.model_validate_json(data)
    except (ValidationError, ValueError) as exc:
        first = str(exc).splitlines()[0]
        log.warning("round costs %s not a record (%s); measuring again", path, first)
        return None
    if stored.key != key:
        log.warning("round costs %s measured for another key; measuring again", path)
        return None
    return stored.costs()


def save_costs(state_dir: Path, key: CostsKey, costs: RoundCosts) -> Path | None:
    """Keep ``costs`` under ``key``; the path, or None (with a warning) if it cannot."""
    record = StoredCosts(
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        key=key,
        plain=costs.plain,
        rounds=costs.rounds,
        verify=costs.verify,
        draft=costs.draft,
    )
    return _write(
        costs_path(state_dir, key), record, "the round costs", "; next run measures again"
    )


def _write(path: Path, record: BaseModel, what: str, then: str = "") -> Path | None:
    """Write ``record`` to ``path`` whole or not at all; the path, or None with a
    warning naming ``what`` (and ``then``) if it cannot."""
    try:
        write_atomically(path, record.model_dump_json(indent=2))
    except OSError as exc:
        log.warning("cannot keep %s under %s (%s)%s", what, path, exc, then)
        return None
    return path


def acceptance_path(state_dir: Path, key: CostsKey) -> Path:
    costs = costs_path(state_dir, key)
    return costs.with_name(costs.stem + "-acceptance.json")


def load_acceptance(state_dir: Path, key: CostsKey) -> tuple[list[int], list[int]] | None:
    """(reached, accepted) kept under ``key``, or None (none kept; one bad file: a
    warning, and the run starts from the neutral guess as before)."""
    path = acceptance_path(state_dir, key)
    try:
        stored = StoredAcceptance.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError, ValueError) as exc:
        first = str(exc).splitlines()[0]
        log.warning("acceptance %s not usable (%s); starting from the guess", path, first)
        return None
    if stored.key != key:
        log.warning("acceptance %s kept for another key; starting from the guess", path)
        return None
    return list(stored.reached), list(stored.accepted)


def save_acceptance(
    state_dir: Path, key: CostsKey, reached: list[int], accepted: list[int]
) -> Path | None:
    """Keep the counts under ``key``; the path, or None (with a warning) if it cannot."""
    record = StoredAcceptance(
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        key=key,
        reached=reached,
        accepted=accepted,
    )
    return _write(acceptance_path(state_dir, key), record, "the acceptance")


def digest(value: Any) -> str:
    """A short stable digest of a JSON-able value (str() for anything else)."""
    canonical = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def model_fingerprint(model: Any, source: str) -> str:
    """The model's identity for timing: where it came from (for a directory, its files'
    names, sizes and modification times, so new weights under the same path count as
    another model), its config, and its parameters' names, shapes and dtypes (after
    sharding and the kernel policy: what the forwards read)."""
    from mlx.utils import tree_flatten

    files: list[tuple[str, int, int]] = []
    path = Path(source).expanduser()
    if path.is_dir():
        for item in sorted(path.iterdir()):
            if item.is_file() and item.suffix in (".json", ".safetensors"):
                stat = item.stat()
                files.append((item.name, stat.st_size, stat.st_mtime_ns))
    args = getattr(model, "args", None)
    config = vars(args) if args is not None and hasattr(args, "__dict__") else repr(args)
    flat = tree_flatten(model.parameters())
    assert isinstance(flat, list)
    shapes = [(name, tuple(array.shape), str(array.dtype)) for name, array in flat]
    return digest({"source": source, "files": files, "config": config, "parameters": shapes})


def run_identity(model: Any, source: str, plan_decisions: Any) -> RunIdentity:
    """The part of a `CostsKey` that is fixed before an engine is built: this rank's
    device and software, the model, the plan's decisions."""
    from mlxserve.hardware.probe import package_version, probe_local

    profile = probe_local()
    return RunIdentity(
        device_type=profile.device_type,
        chip=profile.chip,
        mlx_version=profile.mlx_version,
        mlx_lm_version=package_version("mlx-lm"),
        model=model_fingerprint(model, source),
        plan=digest(plan_decisions),
    )
