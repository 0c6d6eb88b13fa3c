"""The speed rule reads calibration: hazard > override > speed > default rules."""

import shutil
from pathlib import Path

import pytest

from mlxserve.errors import UsageError
from mlxserve.policy.explain import explain_text
from mlxserve.policy.rules import builtin_rules_dir, load_rules
from tests.policy.calibrations import full_faster, record, save, shape
from tests.policy.conftest import PlanFor

M5M = "Apple M5 Max"
M3U = "Apple M3 Ultra"
REASON = "full: 4.1x faster than skip at 512-token chunks on this device (calibrated 2026-12-01)"


def test_speed_beats_the_default_rules(plan_for: PlanFor, tmp_path: Path) -> None:
    plan = plan_for("cpu", state_dir=save(tmp_path, full_faster()))
    decision = plan.ranks[0].decisions["nax_moe"]
    assert (decision.value, decision.rule, decision.reason) == (
        "full",
        "moe-calibrated-fastest",
        REASON,
    )
    assert f"moe-calibrated-fastest: {REASON}" in explain_text(plan)
    assert plan.warnings == []


def test_speed_beats_an_upstream_speed_claim(plan_for: PlanFor, tmp_path: Path) -> None:
    # Two M5 Max: the rules alone pick skip ("2-7% faster"); the measurement wins.
    state = save(tmp_path, full_faster(chip=M5M, device_type="metal"))
    plan = plan_for(f"{M5M},{M5M}", state_dir=state)
    assert [plan.nax_moe(r) for r in range(2)] == ["full", "full"]


def test_stock_call_measured_fastest_keeps_its_name(plan_for: PlanFor, tmp_path: Path) -> None:
    slower = record(shape(512, {"skip": 0.01, "full": 0.02}))
    plan = plan_for("cpu", state_dir=save(tmp_path, slower))
    assert plan.nax_moe(0) == "off"  # the stock call, on a rank without NAX
    assert plan.ranks[0].decisions["nax_moe"].rule == "moe-calibrated-fastest"


def test_hazard_beats_speed(plan_for: PlanFor, tmp_path: Path) -> None:
    # The M5 Max measured skip fastest, but in a mixed cluster its hazard rule decides.
    skip_fastest = record(shape(512, {"skip": 0.01, "full": 0.05}), chip=M5M, device_type="metal")
    plan = plan_for(f"{M3U},{M5M}", state_dir=save(tmp_path, skip_fastest))
    assert plan.nax_moe(1) == "full"
    assert plan.ranks[1].decisions["nax_moe"].rule == "nax-moe-mixed-cluster-full"
    # The M3 Ultra has no record: it keeps its rule.
    assert plan.ranks[0].decisions["nax_moe"].rule == "nax-moe-no-path"


def test_override_beats_speed(plan_for: PlanFor, tmp_path: Path) -> None:
    plan = plan_for("cpu", state_dir=save(tmp_path, full_faster()), overrides=("nax_moe=skip",))
    decision = plan.ranks[0].decisions["nax_moe"]
    assert (decision.value, decision.rule) == ("skip", "override")
    assert "rules chose full by moe-calibrated-fastest" in decision.reason
    assert plan.warnings == []  # a speed rule is no hazard: nothing to warn about


def test_one_calibrated_rank_covers_its_twins_only(plan_for: PlanFor, tmp_path: Path) -> None:
    plan = plan_for("cpu,cpu,Apple M3 Ultra", state_dir=save(tmp_path, full_faster()))
    assert [plan.nax_moe(r) for r in range(3)] == ["full", "full", "off"]
    assert plan.ranks[2].decisions["nax_moe"].rule == "nax-moe-no-path"


def test_stale_calibration_is_ignored_with_a_warning(plan_for: PlanFor, tmp_path: Path) -> None:
    plan = plan_for("cpu", state_dir=save(tmp_path, full_faster(mlx="0.31.0")))
    assert plan.ranks[0].decisions["nax_moe"].rule == "nax-moe-no-path"
    (warning,) = plan.warnings
    assert warning.rule == "calibration"
    assert "ignored the calibration of Linux CPU from mlx 0.31.0 (2026-12-01)" in warning.message
    assert "run `mlxserve policy calibrate` again" in warning.message


def test_failing_variant_is_never_chosen(plan_for: PlanFor, tmp_path: Path) -> None:
    crashed = record(
        shape(512, {"skip": 0.1, "full": 0.01}),
        shape(2048, {"skip": 0.4, "full": "RuntimeError: out of resources"}),
    )
    plan = plan_for("cpu", state_dir=save(tmp_path, crashed))
    decision = plan.ranks[0].decisions["nax_moe"]
    assert decision.value == "off"
    assert "full failed: 2048 tokens" in decision.reason


def test_no_record_means_todays_rules(plan_for: PlanFor, tmp_path: Path) -> None:
    with_dir = plan_for(f"cpu,{M5M},{M3U}", state_dir=tmp_path)
    assert [r.decisions["nax_moe"].rule for r in with_dir.ranks] == [
        "nax-moe-no-path",
        "nax-moe-mixed-cluster-full",
        "nax-moe-no-path",
    ]
    assert with_dir.plan_hash == plan_for(f"cpu,{M5M},{M3U}").plan_hash


def _rules_with(tmp_path: Path, extra: str) -> Path:
    rules = tmp_path / "rules"
    shutil.copytree(builtin_rules_dir(), rules)
    (rules / "extra.toml").write_text(extra)
    return rules


def test_a_speed_rule_above_a_hazard_is_refused(tmp_path: Path) -> None:
    rules = _rules_with(
        tmp_path,
        '[[rule]]\nid = "too-fast"\ntitle = "t"\npriority = 500\nscope = "rank"\n'
        'decide = { nax_moe = "fastest" }\nreason = "r"\n',
    )
    with pytest.raises(UsageError, match=r"speed rule too-fast .* must rank below hazard rule"):
        load_rules(rules)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('decide = { startup = "fastest" }\nscope = "world"', "startup is not calibrated"),
        ('decide = { nax_moe = "fastest" }\nscope = "rank"\nhazard = true', "hazard rule cannot"),
    ],
)
def test_fastest_only_where_calibration_decides(tmp_path: Path, body: str, message: str) -> None:
    rules = _rules_with(
        tmp_path, f'[[rule]]\nid = "x"\ntitle = "t"\npriority = 1\n{body}\nreason = "r"\n'
    )
    with pytest.raises(UsageError, match=message):
        load_rules(rules)
