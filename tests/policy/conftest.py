"""Plans for simulated clusters, built through the same path as the CLI."""

from collections.abc import Callable
from pathlib import Path

import pytest

from mlxserve.config import load_settings
from mlxserve.hardware.simulate import parse_cluster_spec
from mlxserve.policy.plan import Plan
from mlxserve.startup.plan import build_plan

PlanFor = Callable[..., Plan]


@pytest.fixture
def plan_for(monkeypatch: pytest.MonkeyPatch) -> PlanFor:
    for name in ("MLX_RANK", "MLX_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)

    def make(
        cluster: str,
        *,
        backend: str | None = None,
        wires: int = 0,
        nax_moe: str = "auto",
        overrides: tuple[str, ...] = (),
        state_dir: Path | None = None,
        rules_dir: Path | None = None,
    ) -> Plan:
        cli: dict[str, object] = {
            "cluster": {"simulate": parse_cluster_spec(cluster), "wires": wires},
            "policy": {"nax_moe": nax_moe, "overrides": list(overrides)},
        }
        if state_dir is not None:
            cli["server"] = {"state_dir": state_dir}
        if rules_dir is not None:
            cli["policy"]["rules_dir"] = rules_dir  # type: ignore[index]
        if backend:
            cli["cluster"]["backend"] = backend  # type: ignore[index]
        plan, _ = build_plan(load_settings(None, cli))
        return plan

    return make
