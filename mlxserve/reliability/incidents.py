"""Incident memory: the hangs and watchdog exits seen here, kept across restarts.

Why remember: a kernel choice that wedged a collective once will likely do it
again on the same kind of cluster. The front writes one record per watchdog
exit (75) or declared hang, with the plan it ran under; the next plan reads
them through the rule `incident-pinned` (policies/incidents.toml), so the
reason shows in `mlxserve policy explain`. `mlxserve policy incidents --clear`
forgets them. The newest `KEPT` records are kept, in `incidents.json` of the
state directory (written whole, atomically).
"""

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mlxserve.errors import UsageError

log = logging.getLogger(__name__)

FILE_NAME: Final = "incidents.json"
KEPT: Final = 100
#: The kinds that are remembered: the engine (or its collective) stopped making progress.
REMEMBERED: Final = ("watchdog", "hung")


class IncidentRecord(BaseModel):
    """One remembered incident; `composition` and `chips` say which cluster it was."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    at: float = Field(description="wall time (seconds since the epoch)")
    kind: str
    backend: str
    plan_hash: str
    composition: str
    chips: list[str]
    decisions: dict[str, Any] = Field(description="the plan's decision values per rank and world")
    step_kind: str | None = Field(None, description="the kind of step in flight, when known")
    evidence: dict[str, Any] | None = Field(
        None,
        description="what verified the hang: the engine's step counter and answer, and what "
        "the front saw (`mlxserve.reliability.hang.Evidence`); none for a watchdog exit",
    )

    def same_cluster(self, composition: str, chips: list[str]) -> bool:
        return self.composition == composition and self.chips == chips

    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at))


def from_plan(
    plan: dict[str, Any],
    *,
    kind: str,
    backend: str,
    at: float,
    step_kind: str | None,
    evidence: dict[str, Any] | None = None,
) -> IncidentRecord:
    """A record of an incident under `plan` (a plan document, as an engine's hello carries)."""
    ranks = plan.get("ranks", [])
    decisions = {
        "ranks": [{k: d["value"] for k, d in r["decisions"].items()} for r in ranks],
        "world": {k: d["value"] for k, d in plan.get("world", {}).items()},
    }
    return IncidentRecord(
        at=at,
        kind=kind,
        backend=backend,
        plan_hash=str(plan.get("plan_hash", "none")),
        composition=str(plan.get("composition", "unknown")),
        chips=[str(r["profile"].get("chip", "?")) for r in ranks],
        decisions=decisions,
        step_kind=step_kind,
        evidence=evidence,
    )


class IncidentStore:
    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE_NAME

    def load(self) -> list[IncidentRecord]:
        """The records, oldest first; a missing file is none, a broken one a `UsageError`."""
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise UsageError(f"{self.path}: cannot read the incident memory: {exc}") from None
        try:
            return [IncidentRecord.model_validate(item) for item in raw]
        except (ValidationError, TypeError) as exc:
            raise UsageError(
                f"{self.path}: not an incident memory ({exc.__class__.__name__}); "
                "remove it or run `mlxserve policy incidents --clear`"
            ) from None

    def append(self, record: IncidentRecord) -> None:
        self._write([*self.load(), record][-KEPT:])

    def clear(self) -> int:
        """Forget every record; returns how many there were."""
        count = len(self.load()) if self.path.exists() else 0
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        return count

    def _write(self, records: list[IncidentRecord]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps([r.model_dump(mode="json") for r in records], indent=1)
        fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".incidents-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(data)
            os.replace(temporary, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def latest_for(
    records: list[IncidentRecord], composition: str, chips: list[str]
) -> IncidentRecord | None:
    """The newest remembered incident of this kind of cluster, if any."""
    matching = [r for r in records if r.kind in REMEMBERED and r.same_cluster(composition, chips)]
    return max(matching, key=lambda r: r.at) if matching else None
