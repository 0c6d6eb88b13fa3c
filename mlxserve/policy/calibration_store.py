"""Where calibration records live: one JSON file per device in the state directory.

A record is written whole or not at all (a temporary file renamed into place), so an
interrupted calibration never leaves a half-written record for the next plan to read.
Calibrating again on the same device replaces its record.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from pydantic import ValidationError

from mlxserve.errors import UsageError
from mlxserve.policy.calibration import CalibrationRecord, Verdict

SUBDIR = "calibration"


def record_path(state_dir: Path, device_type: str, chip: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{device_type} {chip}".lower()).strip("-")
    return state_dir / SUBDIR / f"{slug}.json"


def save_record(state_dir: Path, record: CalibrationRecord) -> Path:
    """Write ``record`` atomically; returns its path. OS errors become a `UsageError`."""
    path = record_path(state_dir, record.device_type, record.chip)
    try:
        write_atomically(path, record.model_dump_json(indent=2))
    except OSError as exc:
        raise UsageError(f"cannot write the calibration record under {state_dir}: {exc}") from None
    return path


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary file renamed into
    place), making its directory; OS errors propagate. Other records kept in the state
    directory (`mlxserve.engine.spec.cost_store`) are written this way too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_records(state_dir: Path) -> list[CalibrationRecord]:
    """Every record in ``state_dir`` (none when it has none). A bad file is a `UsageError`."""
    directory = state_dir / SUBDIR
    if not directory.is_dir():
        return []
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            records.append(CalibrationRecord.model_validate_json(path.read_bytes()))
        except (OSError, ValidationError, ValueError) as exc:
            first = str(exc).splitlines()[0]
            raise UsageError(
                f"{path}: not a calibration record ({first}); run `mlxserve policy calibrate` "
                "again or delete the file"
            ) from None
    return records


def load_verdicts(state_dir: Path) -> list[Verdict]:
    """The verdict of every record in ``state_dir`` that has one."""
    return [v for record in load_records(state_dir) if (v := record.verdict()) is not None]
