"""The verdict a calibration record gives the speed rule, and how records are stored."""

import json
from pathlib import Path

import pytest

from mlxserve.errors import UsageError
from mlxserve.policy.calibration import CalibrationRecord, merge_verdicts, verdict_for
from mlxserve.policy.calibration_store import load_records, load_verdicts, record_path, save_record
from tests.policy.calibrations import full_faster, record, shape

CRASH = "RuntimeError: cuGraphAddKernelNode(...) failed: invalid argument"


def test_faster_variant_wins_with_its_ratio_and_date() -> None:
    verdict = full_faster().verdict()
    assert verdict is not None
    assert (verdict.variant, verdict.baseline, verdict.ratio, verdict.chunk) == (
        "full",
        "skip",
        4.1,
        512,
    )
    assert verdict.reason("full") == (
        "full: 4.1x faster than skip at 512-token chunks on this device (calibrated 2026-12-01)"
    )


def test_slower_variant_leaves_the_stock_call() -> None:
    verdict = record(shape(512, {"skip": 0.02, "full": 0.03})).verdict()
    assert verdict is not None and verdict.variant == "skip"
    assert "full took 1.50x its time at 512-token chunks" in verdict.reason("skip")


def test_a_gain_within_noise_keeps_the_stock_call() -> None:
    verdict = record(shape(512, {"skip": 0.0100, "full": 0.0097})).verdict()
    assert verdict is not None and verdict.variant == "skip"


def test_a_failing_variant_is_never_chosen() -> None:
    # full is 10x faster where it ran, but it crashed at 2048 tokens.
    verdict = record(
        shape(512, {"skip": 0.1, "full": 0.01}), shape(2048, {"skip": 0.4, "full": CRASH})
    ).verdict()
    assert verdict is not None and verdict.variant == "skip"
    assert verdict.failed["full"].endswith(CRASH)
    assert "2048 tokens x 256 experts x top-6 (K 4096, N 2048)" in verdict.failed["full"]
    assert "full failed: 2048 tokens" in verdict.reason("skip")


def test_a_failing_stock_call_leaves_the_variant_that_ran() -> None:
    verdict = record(
        shape(512, {"skip": 0.1, "full": 0.05}), shape(2048, {"skip": CRASH, "full": 0.2})
    ).verdict()
    assert verdict is not None and verdict.variant == "full"
    assert verdict.ratio is None and "skip failed" in verdict.reason("full")


def test_a_variant_with_different_output_is_never_chosen() -> None:
    wrong = record(shape(512, {"skip": 0.1, "full": 0.01}))
    data = wrong.model_dump()
    data["shapes"][0]["results"][1]["max_abs_diff"] = 0.5
    verdict = CalibrationRecord.model_validate(data).verdict()
    assert verdict is not None and verdict.variant == "skip"
    assert "output differs from skip" in verdict.failed["full"]


def test_no_safe_variant_gives_no_verdict() -> None:
    assert record(shape(512, {"skip": CRASH, "full": CRASH})).verdict() is None
    assert record().verdict() is None


def test_verdicts_match_chip_device_and_mlx_version() -> None:
    old = full_faster(mlx="0.31.0", created_at="2026-10-01T00:00:00+00:00").verdict()
    new = full_faster(mlx="0.32.4").verdict()
    other = full_faster(mlx="0.32.4", chip="Apple M5 Max", device_type="metal").verdict()
    assert old and new and other
    assert verdict_for("Linux CPU", "cpu", "0.32.4", [old, new, other]) == (new, None)
    assert verdict_for("Linux CPU", "cpu", "0.33.0", [old, new, other]) == (None, new)
    assert verdict_for("NVIDIA GPU", "cuda", "0.32.4", [old, new, other]) == (None, None)


def test_ranks_verdicts_merge_newest_first_in_one_order() -> None:
    """What every rank plans with after the exchange: per chip, device and mlx version the
    newest verdict, sorted, whichever rank sent what."""
    older = full_faster(mlx="0.32.4", created_at="2026-10-01T00:00:00+00:00").verdict()
    newer = full_faster(mlx="0.32.4").verdict()
    other = full_faster(mlx="0.32.4", chip="Apple M5 Max", device_type="metal").verdict()
    assert older and newer and other
    merged = merge_verdicts([[older, other], [newer], []])
    assert merged == [other, newer]
    assert merge_verdicts([[newer], [other, older]]) == merged
    assert merge_verdicts([]) == []


def test_records_round_trip_and_replace_the_device_record(tmp_path: Path) -> None:
    first = save_record(tmp_path, full_faster())
    second = save_record(tmp_path, record(shape(512, {"skip": 0.01, "full": 0.02})))
    assert first == second == record_path(tmp_path, "cpu", "Linux CPU")
    assert [p.name for p in first.parent.iterdir()] == ["cpu-linux-cpu.json"]
    (verdict,) = load_verdicts(tmp_path)
    assert verdict.variant == "skip"
    assert load_records(tmp_path / "nowhere") == []


@pytest.mark.parametrize("text", ["{", json.dumps({"schema_version": 7})])
def test_a_bad_record_is_one_clear_error(tmp_path: Path, text: str) -> None:
    path = record_path(tmp_path, "cpu", "x")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(UsageError, match=r"cpu-x.json: not a calibration record .*calibrate"):
        load_records(tmp_path)


def test_an_unwritable_state_dir_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UsageError, match="cannot write the calibration record"):
        save_record(blocker, full_faster())
