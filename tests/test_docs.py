"""The docs build cleanly and keep up with the code.

- The site builds with `mkdocs build --strict`: a broken link, anchor or nav
  entry fails the test.
- Every setting of `mlxserve.config.Settings` (nested sections included) has a
  row in docs/configuration.md, every rule in policies/*.toml and every
  decision in the registry is named in docs/policy.md. A new setting or rule
  without docs fails here, naming what is missing.
"""

import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from mlxserve.config import Settings
from mlxserve.policy.decisions import DECISIONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 120


def test_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}{result.stdout}"
    for page in ("index.html", "configuration/index.html", "policy/index.html"):
        assert (site / page).is_file(), f"{page} missing from the built site"


def _settings_paths(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Dotted paths of every setting; a field whose type is a model is a section."""
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _settings_paths(annotation, path)
        else:
            yield path


def test_settings_walk_finds_nested_fields() -> None:
    paths = {".".join(path) for path in _settings_paths(Settings)}
    assert {"model", "policy.nax_moe", "cluster.simulate"} <= paths


def test_every_setting_is_documented() -> None:
    rows = [
        line
        for line in (DOCS / "configuration.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("|")
    ]
    missing = []
    for path in _settings_paths(Settings):
        env_name = "MLXSERVE_" + "__".join(part.upper() for part in path)
        key = f"`{path[-1]}`"
        if not any(f"`{env_name}`" in row and key in row for row in rows):
            missing.append(f"{'.'.join(path)} (env {env_name})")
    assert not missing, (
        "settings without a row (key and env var) in docs/configuration.md: " + ", ".join(missing)
    )


def _rule_ids() -> list[str]:
    ids = []
    for path in sorted((ROOT / "policies").glob("*.toml")):
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        ids += [rule["id"] for rule in data.get("rule", [])]
    return ids


def test_every_rule_and_decision_is_documented() -> None:
    text = (DOCS / "policy.md").read_text(encoding="utf-8")
    rule_ids = _rule_ids()
    assert rule_ids, "no rules found in policies/"
    missing = [f"rule {name}" for name in rule_ids if f"`{name}`" not in text]
    missing += [f"decision {key}" for key in DECISIONS if f"`{key}`" not in text]
    assert not missing, "not named in docs/policy.md: " + ", ".join(missing)
