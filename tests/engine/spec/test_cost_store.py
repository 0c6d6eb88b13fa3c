"""The automatic depth's calibration is measured once per key and kept in the state
directory: a later engine reads it instead of measuring (counted by
`Engine.calibrations`), another model measures again, a bad file costs one warning
and a measurement, and under tensor parallelism rank 0's stored costs go to the
followers with the step, so no rank measures alone."""

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from mlx.nn.layers.base import Module

from mlxserve.channel.request import GenerationParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig
from mlxserve.engine.process import lockstep
from mlxserve.engine.process.lockstep import LockstepLeader, StepMessage, follow
from mlxserve.engine.spec.cost_store import (
    CostsPlace,
    acceptance_path,
    costs_path,
    load_acceptance,
    load_costs,
    run_identity,
    save_costs,
)
from mlxserve.engine.spec.costs import RoundCosts, measure_round_costs
from mlxserve.engine.spec.mtp import MTPAdapter
from mlxserve.hardware.clock import cost_clock
from tests.engine.drive import run
from tests.engine.v4_models import tiny_v4

PROMPT = tuple(range(3, 15))


@pytest.fixture(scope="module")
def model() -> Module:
    return tiny_v4()


def _place(model: Module, state_dir: Path, source: str = "tiny") -> CostsPlace:
    return CostsPlace(state_dir, run_identity(model, source, {"moe": "skip"}))


def _engine(
    model: Module, place: CostsPlace | None, leader: LockstepLeader | None = None
) -> Engine:
    adapter = MTPAdapter(model)
    adapter.max_draft_depth = 2  # a shorter calibration (it times every depth)

    def short_measurement(
        tick: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter
    ) -> RoundCosts:
        """The engine's measurement, one trial of short probes: what is stored matters here."""
        return measure_round_costs(
            adapter, trials=1, steps=2, context=8, tick=tick, clock=clock, parts=False
        )

    adapter.measure_costs = short_measurement  # type: ignore[method-assign]
    config = EngineConfig(speculative_depth="auto", round_costs=place)
    return Engine(adapter, config, lockstep=leader)


def _serve_one(engine: Engine) -> None:
    tokens, finish = run(engine, GenerationRequest("r", GenerationParams(PROMPT, 6)))["r"]
    assert finish.finish_reason == "length" and len(tokens) == 6


def test_a_measured_calibration_is_kept_and_the_next_engine_reads_it(
    model: Module, tmp_path: Path
) -> None:
    place = _place(model, tmp_path)
    first = _engine(model, place)
    _serve_one(first)
    assert first.calibrations == 1 and first.depth_picker is not None
    key = first._costs_key(place)
    assert costs_path(tmp_path, key).is_file()
    assert load_costs(tmp_path, key) == first.depth_picker.calibrated

    second = _engine(model, place)
    _serve_one(second)
    assert second.calibrations == 0  # read, not measured
    assert second.depth_picker is not None
    assert second.depth_picker.calibrated == first.depth_picker.calibrated


def test_the_acceptance_seen_is_kept_and_the_next_engine_starts_from_it(
    model: Module, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The depth picker's acceptance counts are written when a request with an
    automatic depth finishes (before its finish event), and a later engine's picker
    starts from them; a damaged file costs one warning and the neutral start."""
    place = _place(model, tmp_path)
    first = _engine(model, place)
    _serve_one(first)
    assert first.depth_picker is not None
    key = first._costs_key(place)
    kept = load_acceptance(tmp_path, key)
    assert kept == first.depth_picker.kept_history()
    assert kept is not None and sum(kept[0]) > 0  # the request drafted
    second = _engine(model, place)
    _serve_one(second)
    assert second.depth_picker is not None and second.depth_picker.seeded.reached_at_depth
    assert second.depth_picker.seeded.reached_at_depth == kept[0]

    acceptance_path(tmp_path, key).write_text('{"schema_version": 1, "reached": [1], ')
    third = _engine(model, place)
    with caplog.at_level(logging.WARNING, logger="mlxserve.engine.spec.cost_store"):
        _serve_one(third)
    assert any("starting from the guess" in r.getMessage() for r in caplog.records)
    assert third.depth_picker is not None and not third.depth_picker.seeded.reached_at_depth


def test_another_model_or_tuning_is_measured_again(model: Module, tmp_path: Path) -> None:
    place = _place(model, tmp_path)
    _serve_one(_engine(model, place))
    other = tiny_v4(vocab_size=67)
    other_place = _place(other, tmp_path)
    assert other_place.identity.model != place.identity.model
    engine = _engine(other, other_place)
    _serve_one(engine)
    assert engine.calibrations == 1
    kept = list((tmp_path / "round_costs").glob("*.json"))
    assert len([p for p in kept if not p.stem.endswith("-acceptance")]) == 2
    # What else the measurement depends on is in the key too.
    key = place.key({"speculative_batch": 2}, 2, "process_time")
    assert place.key({"speculative_batch": 4}, 2, "process_time").digest() != key.digest()
    assert place.key({"speculative_batch": 2}, 3, "process_time").digest() != key.digest()
    wider = CostsPlace(tmp_path, place.identity, world_size=2)
    assert wider.key({"speculative_batch": 2}, 2, "process_time").digest() != key.digest()


@pytest.mark.parametrize("damage", ["not json", "another key", "negative"])
def test_a_bad_record_costs_one_warning_and_a_measurement(
    model: Module, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    place = _place(model, tmp_path)
    engine = _engine(model, place)
    key = engine._costs_key(place)
    path = costs_path(tmp_path, key)
    path.parent.mkdir(parents=True)
    if damage == "not json":
        path.write_text('{"schema_version": 1, "plain": ')
    else:
        assert save_costs(tmp_path, key, RoundCosts(plain=0.01, rounds={1: 0.02})) == path
        record = json.loads(path.read_text())
        if damage == "another key":
            record["key"]["model"] = "someone-else"
        else:
            record["plain"] = -1.0
        path.write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="mlxserve.engine.spec.cost_store"):
        _serve_one(engine)
    warnings = [r for r in caplog.records if r.name == "mlxserve.engine.spec.cost_store"]
    assert len(warnings) == 1 and "measuring again" in warnings[0].getMessage()
    assert engine.calibrations == 1
    assert load_costs(tmp_path, key) == engine.depth_picker.calibrated  # type: ignore[union-attr]


def test_an_unwritable_state_dir_only_warns(
    model: Module, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory would go
    engine = _engine(model, _place(model, blocked))
    with caplog.at_level(logging.WARNING, logger="mlxserve.engine.spec.cost_store"):
        _serve_one(engine)
    assert engine.calibrations == 1
    assert any("cannot keep the round costs" in r.getMessage() for r in caplog.records)


def _recorder(sent: list[bytes]) -> Callable[[object, bytes], bytes]:
    """A broadcast from rank 0 that only records what it sends."""

    def broadcast(_: object, data: bytes) -> bytes:
        sent.append(data)
        return data

    return broadcast


class _Rank:
    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def test_rank_0_sends_its_stored_costs_and_no_rank_measures(
    model: Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 decides: with a stored calibration it measures nothing and sends the
    costs with the calibrating step; the follower (which keeps no store of its own)
    takes them. Had rank 0 skipped the measurement and a follower not, the follower's
    probes would wait forever on collectives rank 0 never joins."""
    place = _place(model, tmp_path)
    stored = RoundCosts(plain=0.01, rounds={1: 0.012, 2: 0.02})
    leader_engine = _engine(model, place, LockstepLeader(_Rank(0)))
    save_costs(tmp_path, leader_engine._costs_key(place), stored)
    sent: list[bytes] = []
    monkeypatch.setattr(lockstep, "broadcast_bytes", _recorder(sent))
    _serve_one(leader_engine)
    assert leader_engine.calibrations == 0
    messages = [StepMessage.from_bytes(data) for data in sent]
    carrying = [m for m in messages if m.round_costs is not None]
    assert len(carrying) == 1 and carrying[0].round_costs == stored
    assert carrying[0].step is not None and carrying[0].step.kind == "speculate"

    feed = iter([*sent, StepMessage(stop=True).to_bytes()])
    monkeypatch.setattr(lockstep, "broadcast_bytes", lambda _, data: next(feed))
    follower = _engine(model, None)
    assert follow(follower, _Rank(1)) == len(messages)
    assert follower.calibrations == 0
    assert follower.depth_picker is not None and follower.depth_picker.calibrated == stored


def test_without_a_stored_calibration_every_rank_measures_in_the_same_step(
    model: Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[bytes] = []
    monkeypatch.setattr(lockstep, "broadcast_bytes", _recorder(sent))
    leader_engine = _engine(model, _place(model, tmp_path), LockstepLeader(_Rank(0)))
    _serve_one(leader_engine)
    assert leader_engine.calibrations == 1
    assert not any(StepMessage.from_bytes(data).round_costs for data in sent)
    feed = iter([*sent, StepMessage(stop=True).to_bytes()])
    monkeypatch.setattr(lockstep, "broadcast_bytes", lambda _, data: next(feed))
    follower = _engine(model, None)
    follow(follower, _Rank(1))
    assert follower.calibrations == 1


def test_the_key_names_the_clock_that_timed_it(model: Module, tmp_path: Path) -> None:
    place = _place(model, tmp_path)
    key = _engine(model, place)._costs_key(place)
    assert key.clock == cost_clock().__name__ and key.world_size == 1 and key.max_depth == 2


def test_only_rank_0_of_an_automatic_depth_keeps_costs(model: Module, tmp_path: Path) -> None:
    """`build_engine`'s place for the store: the state directory, on rank 0 with an
    automatic depth; none on a follower (rank 0 decides) or a fixed depth."""
    from mlxserve.config import load_settings
    from mlxserve.engine.core.build import LoadedModel, costs_place
    from mlxserve.startup.plan import build_plan

    settings = load_settings(None, {"model": "demo", "server": {"state_dir": str(tmp_path)}})
    plan, _ = build_plan(settings)
    auto = LoadedModel(model, None, MTPAdapter(model), "auto")
    place = costs_place(settings, plan, auto, 0, 1)
    assert place is not None and place.state_dir == tmp_path and place.world_size == 1
    assert place.identity.model == _place(model, tmp_path, "demo").identity.model
    assert costs_place(settings, plan, auto, 1, 2) is None
    fixed = LoadedModel(model, None, MTPAdapter(model), 2)
    assert costs_place(settings, plan, fixed, 0, 1) is None


def test_a_kept_calibration_picks_the_first_round_too(model: Module, tmp_path: Path) -> None:
    place = _place(model, tmp_path)
    _serve_one(_engine(model, place))
    key = _engine(model, place)._costs_key(place)
    kept = load_costs(tmp_path, key)
    assert kept is not None
    # Kept costs where drafting never pays: every round is a plain step, the first
    # one too (without them it drafts `FIRST_DEPTH`, before the costs are read).
    slow = {1: kept.plain * 50, 2: kept.plain * 60}
    save_costs(tmp_path, key, RoundCosts(plain=kept.plain, rounds=slow))
    engine = _engine(model, place)
    tokens, finish = run(engine, GenerationRequest("r", GenerationParams(PROMPT, 6)))["r"]
    assert len(tokens) == 6 and engine.calibrations == 0
    assert finish.speculative is not None
    assert finish.speculative["drafted"] == 0, finish.speculative
