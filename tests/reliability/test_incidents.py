"""The incident memory file: newest 100 kept, written whole, cleared, a broken file named."""

from pathlib import Path

import pytest

from mlxserve.errors import UsageError
from mlxserve.reliability.incidents import (
    KEPT,
    IncidentRecord,
    IncidentStore,
    from_plan,
    latest_for,
)

PLAN: dict[str, object] = {
    "plan_hash": "ab" * 32,
    "composition": "all_nax",
    "ranks": [
        {"profile": {"chip": "Apple M5 Max"}, "decisions": {"nax_moe": {"value": "skip"}}},
        {"profile": {"chip": "Apple M5 Max"}, "decisions": {"nax_moe": {"value": "skip"}}},
    ],
    "world": {"progress_timeout_s": {"value": 30.0}},
}


def record(at: float, kind: str = "watchdog", chips: int = 2) -> IncidentRecord:
    return IncidentRecord(
        at=at,
        kind=kind,
        backend="primary",
        plan_hash="ab" * 32,
        composition="all_nax",
        chips=["Apple M5 Max"] * chips,
        decisions={},
    )


def test_keeps_the_newest_hundred_and_clears(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "state")
    assert store.load() == []
    for at in range(KEPT + 5):
        store.append(record(float(at)))
    kept = store.load()
    assert len(kept) == KEPT == 100 and kept[0].at == 5.0 and kept[-1].at == KEPT + 4
    assert store.clear() == KEPT and store.load() == [] and store.clear() == 0


def test_a_broken_file_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path)
    store.path.write_text('[{"at": "soon"}]')
    with pytest.raises(UsageError, match=rf"{store.path}: not an incident memory"):
        store.load()


def test_only_hangs_of_the_same_cluster_count() -> None:
    records = [record(1.0), record(3.0, kind="crash"), record(2.0), record(9.0, chips=4)]
    newest = latest_for(records, "all_nax", ["Apple M5 Max"] * 2)
    assert newest is not None and newest.at == 2.0
    assert latest_for(records, "mixed_nax", ["Apple M3 Ultra", "Apple M5 Max"]) is None


def test_a_record_from_a_plan_document() -> None:
    made = from_plan(PLAN, kind="hung", backend="primary", at=5.0, step_kind="decode")
    assert made.chips == ["Apple M5 Max"] * 2 and made.composition == "all_nax"
    assert made.decisions["ranks"] == [{"nax_moe": "skip"}] * 2
    assert made.decisions["world"] == {"progress_timeout_s": 30.0}
    assert made.step_kind == "decode" and made.plan_hash == "ab" * 32
