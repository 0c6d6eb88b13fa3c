"""Table of cluster compositions and the decisions the shipped rules must make."""

import pytest

from tests.policy.conftest import PlanFor

M3U, M5M, M5P, M4M = "Apple M3 Ultra", "Apple M5 Max", "Apple M5 Pro", "Apple M4 Max"

# (case id, --cluster spec, backend, expected nax_moe per rank, expected deciding rule per rank)
COMPOSITIONS = [
    ("one M5 Max", M5M, None, ["skip"], ["nax-moe-homogeneous-skip"]),
    ("two M5 Max", f"{M5M},{M5M}", None, ["skip", "skip"], ["nax-moe-homogeneous-skip"] * 2),
    (
        "M3 Ultra + M5 Max",
        f"{M3U},{M5M}",
        None,
        ["off", "full"],
        ["nax-moe-no-path", "nax-moe-mixed-cluster-full"],
    ),
    (
        "M5 Max + M3 Ultra",
        f"{M5M},{M3U}",
        None,
        ["full", "off"],
        ["nax-moe-mixed-cluster-full", "nax-moe-no-path"],
    ),
    ("two M3 Ultra", f"{M3U},{M3U}", None, ["off", "off"], ["nax-moe-no-path"] * 2),
    (
        "M4 Max + M5 Pro",
        f"{M4M},{M5P}",
        None,
        ["off", "full"],
        ["nax-moe-no-path", "nax-moe-mixed-cluster-full"],
    ),
    (
        "four ranks mixed",
        f"{M5M},{M5M},{M3U},{M5P}",
        None,
        ["full", "full", "off", "full"],
        ["nax-moe-mixed-cluster-full"] * 2 + ["nax-moe-no-path", "nax-moe-mixed-cluster-full"],
    ),
    ("four M5", f"{M5M},{M5M},{M5P},{M5P}", None, ["skip"] * 4, ["nax-moe-homogeneous-skip"] * 4),
    ("Linux CPU ranks", "cpu,cpu", None, ["off", "off"], ["nax-moe-no-path"] * 2),
    (
        "M5 on macOS 26.1 beside an M5 on 26.2",
        f"{M5M}:macos=26.1,{M5M}",
        None,
        ["off", "full"],
        ["nax-moe-no-path", "nax-moe-mixed-cluster-full"],
    ),
    ("M5 alone on macOS 26.1", f"{M5M}:macos=26.1", None, ["off"], ["nax-moe-no-path"]),
    (
        "A19-class phone GPU rule does not apply to Macs: M5 base",
        "Apple M5,Apple M5",
        None,
        ["skip", "skip"],
        ["nax-moe-homogeneous-skip"] * 2,
    ),
]


@pytest.mark.parametrize(
    ("cluster", "backend", "expected", "rules"),
    [case[1:] for case in COMPOSITIONS],
    ids=[case[0] for case in COMPOSITIONS],
)
def test_nax_moe_per_composition(
    plan_for: PlanFor, cluster: str, backend: str | None, expected: list[str], rules: list[str]
) -> None:
    plan = plan_for(cluster, backend=backend)
    assert [plan.nax_moe(r) for r in range(plan.world_size)] == expected
    assert [rank.decisions["nax_moe"].rule for rank in plan.ranks] == rules
    assert plan.simulated
    assert all(rank.profile["simulated"] for rank in plan.ranks)
    assert plan.world_value("startup") == "allow"
    assert plan.warnings == []


# (mlx version on every rank, nax_moe of two M5 Max, rows-per-expert floor, startup with jaccl)
MLX_VERSIONS = [
    ("0.31.2", "skip", 64, "refuse"),
    ("0.32.0", "skip", 64, "allow"),
    ("0.32.1", "skip", 0, "allow"),
    ("0.32.2", "skip", 0, "allow"),
    ("0.32.4", "skip", 0, "allow"),
]


@pytest.mark.parametrize(("mlx", "nax_moe", "floor", "startup"), MLX_VERSIONS)
def test_mlx_versions_on_two_m5(
    plan_for: PlanFor, mlx: str, nax_moe: str, floor: int, startup: str
) -> None:
    plan = plan_for(f"{M5M}:mlx={mlx},{M5M}:mlx={mlx}", backend="jaccl")
    assert [plan.nax_moe(r) for r in range(2)] == [nax_moe, nax_moe]
    assert [plan.rank_value(r, "moe_rows_per_expert_min") for r in range(2)] == [floor, floor]
    assert plan.world_value("startup") == startup
    if mlx < "0.32.2":
        assert plan.ranks[0].decisions["nax_moe"].rule == "nax-moe-before-4352"
        assert "already computes every simdgroup" in plan.ranks[0].decisions["nax_moe"].reason


def test_version_floor_applies_only_to_nax_ranks(plan_for: PlanFor) -> None:
    plan = plan_for(f"{M3U}:mlx=0.32.0,{M5M}:mlx=0.32.0", backend="ring")
    assert [plan.rank_value(r, "moe_rows_per_expert_min") for r in range(2)] == [0, 64]
    # Ranks run in lockstep: the largest floor sets everyone's prefill step.
    # DeepSeek-V4-Flash: 256 experts, top-6 -> 64 * 256 / 6 = 2731 -> 2816.
    assert plan.prefill_step_size(512, num_experts=256, top_k=6) == 2816
    assert plan.prefill_step_size(4096, num_experts=256, top_k=6) == 4096


def test_no_floor_keeps_configured_prefill_step(plan_for: PlanFor) -> None:
    assert plan_for(f"{M5M},{M5M}").prefill_step_size(512, 256, 6) == 512


def test_jaccl_refusal_names_the_rule(plan_for: PlanFor) -> None:
    from mlxserve.errors import UsageError

    plan = plan_for(f"{M3U}:mlx=0.31.2,{M5M}", backend="jaccl")
    assert plan.world["startup"].rule == "jaccl-mesh-allreduce-race"
    with pytest.raises(UsageError, match="jaccl-mesh-allreduce-race"):
        plan.ensure_startable()


def test_jaccl_on_new_mlx_and_ring_on_old_mlx_start(plan_for: PlanFor) -> None:
    plan_for(f"{M5M},{M5M}", backend="jaccl").ensure_startable()
    plan_for(f"{M5M}:mlx=0.31.2,{M5M}:mlx=0.31.2", backend="ring").ensure_startable()


@pytest.mark.parametrize(
    ("mlx", "wires", "warned"),
    [("0.31.2", 2, True), ("0.31.2", 1, False), ("0.32.0", 3, False)],
)
def test_ring_multiwire_deadlock_warning(
    plan_for: PlanFor, mlx: str, wires: int, warned: bool
) -> None:
    plan = plan_for(f"{M5M}:mlx={mlx},{M5M}:mlx={mlx}", backend="ring", wires=wires)
    assert [w.rule for w in plan.warnings] == (
        ["ring-multiwire-prefill-deadlock"] if warned else []
    )
    assert plan.world_value("startup") == "allow"


@pytest.mark.parametrize(
    ("world", "rule"),
    [
        (1, "engine-progress-timeout"),
        (2, "collective-progress-timeout"),
        (4, "collective-progress-timeout"),
    ],
)
def test_progress_timeout(plan_for: PlanFor, world: int, rule: str) -> None:
    plan = plan_for(",".join([M5M] * world))
    assert plan.progress_timeout_s() == 30.0
    assert plan.world["progress_timeout_s"].rule == rule


def test_simulated_backend_defaults(plan_for: PlanFor) -> None:
    assert plan_for(f"{M5M},{M5M}").backend == "jaccl"
    assert plan_for("cpu,cpu").backend == "ring"
    assert plan_for(M5M).backend == "none"
