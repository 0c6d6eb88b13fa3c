"""Rule files are validated on load; every error names the file and the field."""

import re
from pathlib import Path

import pytest

from mlxserve.errors import UsageError
from mlxserve.policy.rules import builtin_rules_dir, load_rules

GOOD = """
[[rule]]
id = "r1"
title = "t"
priority = 0
scope = "rank"
decide = { nax_moe = "off" }
reason = "r"
"""


def test_builtin_rules_load() -> None:
    ruleset = load_rules()
    ids = {rule.id for rule in ruleset.rules}
    assert {"nax-moe-mixed-cluster-full", "jaccl-mesh-allreduce-race"} <= ids
    assert "nax_moe.toml" in ruleset.sources
    assert builtin_rules_dir().name in ("policies", "_policies")


def _write(tmp_path: Path, text: str, name: str = "bad.toml") -> Path:
    (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[rule]\n", "bad.toml: not valid TOML"),
        ("title = 'x'\n", "bad.toml: unknown top-level key 'title'"),
        ("rule = []\n", r"bad.toml: no \[\[rule\]\] tables"),
        (GOOD.replace('title = "t"\n', ""), "bad.toml: rule r1: field 'title': Field required"),
        (GOOD.replace("priority = 0", "priority = 'high'"), "rule r1: field 'priority'"),
        (GOOD.replace('scope = "rank"', 'scope = "galaxy"'), "rule r1: field 'scope'"),
        (GOOD.replace('reason = "r"', 'reason = "r"\ncolour = 1'), "field 'colour': unknown field"),
        (GOOD.replace('nax_moe = "off"', 'nax_moe = "fast"'), "nax_moe must be one of"),
        (GOOD.replace("nax_moe", "nax_mo"), "unknown decision 'nax_mo'"),
        (GOOD.replace('scope = "rank"', 'scope = "world"'), "is rank-scoped, rule is world"),
        (GOOD.replace('id = "r1"', 'id = "R 1"'), "field 'id'"),
        (GOOD + 'when = { mlx = "newest" }\n', "rule r1: field 'when.mlx': not a version range"),
        (GOOD + 'when = { composition = ["some_nax"] }\n', "field 'when.composition.0'"),
        (GOOD + "when = { cpu = true }\n", "field 'when.cpu': unknown field"),
        (GOOD.replace('decide = { nax_moe = "off" }', ""), "must decide something or warn"),
    ],
)
def test_malformed_rule_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        load_rules(_write(tmp_path, text))


def test_duplicate_ids_across_files(tmp_path: Path) -> None:
    _write(tmp_path, GOOD, "a.toml")
    _write(tmp_path, GOOD, "b.toml")
    with pytest.raises(
        UsageError, match=re.escape("b.toml: rule id 'r1' already defined in a.toml")
    ):
        load_rules(tmp_path)


def test_missing_or_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="rules directory not found"):
        load_rules(tmp_path / "nope")
    with pytest.raises(UsageError, match="no rule files"):
        load_rules(tmp_path)


def test_rules_without_a_default_are_caught_at_evaluation(tmp_path: Path) -> None:
    from mlxserve.cluster.discover import simulated_cluster
    from mlxserve.config import ClusterSettings
    from mlxserve.policy.evaluate import evaluate

    cluster = simulated_cluster(ClusterSettings(simulate=["cpu"]))
    with pytest.raises(UsageError, match="no rule decides moe_rows_per_expert_min for rank 0"):
        evaluate(cluster, load_rules(_write(tmp_path, GOOD)), [])


def test_rank_rule_warnings_name_the_rank(tmp_path: Path) -> None:
    from mlxserve.cluster.discover import simulated_cluster
    from mlxserve.config import ClusterSettings
    from mlxserve.policy.evaluate import evaluate

    for name in ("nax_moe.toml", "prefill_step.toml", "distributed.toml", "watchdog.toml"):
        (tmp_path / name).write_text((builtin_rules_dir() / name).read_text())
    (tmp_path / "extra.toml").write_text(
        GOOD.replace('id = "r1"', 'id = "m3-note"')
        + 'warn = "an M3 rank"\nwhen = { chips = ["Apple M3 Ultra"] }\n'
    )
    cluster = simulated_cluster(ClusterSettings(simulate=["Apple M5 Max", "Apple M3 Ultra"]))
    plan = evaluate(cluster, load_rules(tmp_path), [])
    assert [(w.rule, w.message) for w in plan.warnings] == [("m3-note", "rank 1: an M3 rank")]
