"""The shipped hazard rule for an MLX CUDA launch failure (policies/cuda_moe.toml).

Issue 13's GPU run crashed inside MLX CUDA with "cuGraphAddKernelNode(...) failed:
invalid argument". `benchmarks/moe_variants.py --isolate` pinned it on an H200: the
stock sorted call (`skip`) fails at 65536 routed rows and runs at 65528, while
`full` runs both. The engine meets that with a large prefill step, so CUDA ranks
take `full`, above any calibration; an override still wins, with a warning.
"""

import shutil
from pathlib import Path

from mlxserve.policy.rules import builtin_rules_dir
from tests.policy.calibrations import record, save, shape
from tests.policy.conftest import PlanFor


def _rules_without_the_hazard(tmp_path: Path) -> Path:
    rules = tmp_path / "rules"
    shutil.copytree(builtin_rules_dir(), rules)
    (rules / "cuda_moe.toml").unlink()
    return rules


def test_hazard_applies_to_cuda_ranks_only(plan_for: PlanFor, tmp_path: Path) -> None:
    plan = plan_for("cuda,cpu")
    assert [plan.nax_moe(r) for r in range(2)] == ["full", "off"]
    assert plan.ranks[0].decisions["nax_moe"].rule == "cuda-moe-sorted-gather-launch"
    assert plan.ranks[0].profile["device_type"] == "cuda"


def test_hazard_beats_a_calibration_and_warns_on_override(
    plan_for: PlanFor, tmp_path: Path
) -> None:
    stock_fastest = record(
        shape(512, {"skip": 0.01, "full": 0.05}), chip="NVIDIA GPU", device_type="cuda"
    )
    state = save(tmp_path / "state", stock_fastest)
    plan = plan_for("cuda", state_dir=state)
    assert plan.ranks[0].decisions["nax_moe"].rule == "cuda-moe-sorted-gather-launch"
    forced = plan_for("cuda", state_dir=state, overrides=("nax_moe=skip",))
    assert forced.nax_moe(0) == "skip"
    (warning,) = forced.warnings
    assert warning.rule == "cuda-moe-sorted-gather-launch"
    assert "contradicts hazard rule" in warning.message


def test_without_the_rule_cuda_ranks_keep_the_stock_call(plan_for: PlanFor, tmp_path: Path) -> None:
    plan = plan_for("cuda", rules_dir=_rules_without_the_hazard(tmp_path))
    assert plan.ranks[0].decisions["nax_moe"].rule == "nax-moe-no-path"
