"""A hazard rule for an MLX CUDA failure, as it would be written: tested, not shipped.

Issue 13's GPU run crashed inside MLX CUDA with "cuGraphAddKernelNode(...) failed:
invalid argument" without saying which variant. `benchmarks/moe_variants.py` now
records the variant and shape of every failure; if the stock path fails at shapes
the engine meets, `DRAFT` (with the measured shapes in its reason) goes into
`policies/`. Until then it lives here, so the `device` condition and the ordering
it relies on stay tested.
"""

import shutil
from pathlib import Path

from mlxserve.policy.rules import builtin_rules_dir
from tests.policy.calibrations import record, save, shape
from tests.policy.conftest import PlanFor

DRAFT = """
[[rule]]
id = "cuda-moe-sorted-gather-launch"
title = "MLX CUDA: the stock sorted gather_qmm fails to launch"
references = ["mlxserve issue 13: cuGraphAddKernelNode(...) failed: invalid argument"]
priority = 150
scope = "rank"
hazard = true
when = { device = ["cuda"] }
decide = { nax_moe = "full" }
reason = "on MLX CUDA the stock sorted gather_qmm raised cuGraphAddKernelNode(...) failed: \
invalid argument (variant and shapes: from the GPU run); full's expert-aligned tiles run the \
unsorted kernel"
"""


def _rules(tmp_path: Path) -> Path:
    rules = tmp_path / "rules"
    shutil.copytree(builtin_rules_dir(), rules)
    (rules / "cuda_moe.toml").write_text(DRAFT)
    return rules


def test_hazard_applies_to_cuda_ranks_only(plan_for: PlanFor, tmp_path: Path) -> None:
    plan = plan_for("cuda,cpu", rules_dir=_rules(tmp_path))
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
    rules = _rules(tmp_path)
    plan = plan_for("cuda", rules_dir=rules, state_dir=state)
    assert plan.ranks[0].decisions["nax_moe"].rule == "cuda-moe-sorted-gather-launch"
    forced = plan_for("cuda", rules_dir=rules, state_dir=state, overrides=("nax_moe=skip",))
    assert forced.nax_moe(0) == "skip"
    (warning,) = forced.warnings
    assert warning.rule == "cuda-moe-sorted-gather-launch"
    assert "contradicts hazard rule" in warning.message


def test_without_the_draft_cuda_ranks_keep_the_stock_call(plan_for: PlanFor) -> None:
    plan = plan_for("cuda")
    assert plan.ranks[0].decisions["nax_moe"].rule == "nax-moe-no-path"
