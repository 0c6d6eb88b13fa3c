"""Two real ring ranks on loopback exchange profiles and agree on the plan."""

import json
import shutil
from pathlib import Path

import pytest

from tests.cluster.conftest import RunRanks

pytestmark = pytest.mark.slow


def test_two_ring_ranks_with_different_chips_compute_the_same_plan(run_ranks: RunRanks) -> None:
    chips = ["Apple M3 Ultra", "Apple M5 Max"]
    runs = run_ranks(
        ["policy", "explain", "--json"],
        [{"MLXSERVE_CLUSTER__SIMULATE_SELF": chip} for chip in chips],
    )
    for run in runs:
        assert run.returncode == 0, run.stderr
    plans = [json.loads(run.stdout) for run in runs]
    assert plans[0]["plan_hash"] == plans[1]["plan_hash"]
    plan = plans[0]
    # Each rank only knew its own chip: the other came through the all_gather.
    assert [rank["profile"]["chip"] for rank in plan["ranks"]] == chips
    assert plan["backend"] == "ring"
    assert plan["composition"] == "mixed_nax"
    assert plan["simulated"] is True
    assert [r["decisions"]["nax_moe"]["value"] for r in plan["ranks"]] == ["off", "full"]
    assert plan["world"]["progress_timeout_s"]["rule"] == "collective-progress-timeout"


def test_ranks_with_different_rules_refuse_to_start(run_ranks: RunRanks, tmp_path: Path) -> None:
    from mlxserve.policy.rules import builtin_rules_dir

    other = tmp_path / "other-rules"
    shutil.copytree(builtin_rules_dir(), other)
    watchdog = other / "watchdog.toml"
    watchdog.write_text(watchdog.read_text().replace("30.0", "45.0"))
    envs = [
        {"MLXSERVE_CLUSTER__SIMULATE_SELF": "Apple M5 Max"},
        {
            "MLXSERVE_CLUSTER__SIMULATE_SELF": "Apple M5 Max",
            "MLXSERVE_POLICY__RULES_DIR": str(other),
        },
    ]
    runs = run_ranks(["policy", "explain"], envs)
    for run in runs:
        assert run.returncode == 2
        assert "ranks computed different plans" in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1


def test_one_calibrated_rank_covers_its_twin(run_ranks: RunRanks, tmp_path: Path) -> None:
    from tests.policy.calibrations import full_faster, save

    calibrated = save(tmp_path / "rank0", full_faster(chip="Apple M5 Max", device_type="metal"))
    envs = [
        {"MLXSERVE_CLUSTER__SIMULATE_SELF": "Apple M5 Max", "MLXSERVE_SERVER__STATE_DIR": str(d)}
        for d in (calibrated, tmp_path / "rank1-has-none")
    ]
    runs = run_ranks(["policy", "explain", "--json"], envs)
    for run in runs:
        assert run.returncode == 0, run.stderr
    plans = [json.loads(run.stdout) for run in runs]
    assert plans[0]["plan_hash"] == plans[1]["plan_hash"]
    decisions = [r["decisions"]["nax_moe"] for r in plans[0]["ranks"]]
    assert [(d["value"], d["rule"]) for d in decisions] == [("full", "moe-calibrated-fastest")] * 2
