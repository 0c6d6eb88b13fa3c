"""Settings: file < environment < CLI, and one-line errors that name the key."""

import re
from collections.abc import Iterator
from pathlib import Path
from typing import get_args, get_origin

import pytest
from pydantic import BaseModel

from mlxserve.config import Settings, load_settings
from mlxserve.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("MLXSERVE_"):
            monkeypatch.delenv(name)


def test_shipped_config_loads() -> None:
    settings = load_settings(REPO / "config.toml")
    assert settings.model == "demo"
    assert settings.policy.nax_moe == "auto"
    assert settings.cluster.simulate == []


def test_precedence_file_env_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[policy]\nnax_moe = "full"\n[cluster]\nwires = 2\n')
    assert load_settings(path).policy.nax_moe == "full"
    monkeypatch.setenv("MLXSERVE_POLICY__NAX_MOE", "skip")
    settings = load_settings(path)
    assert settings.policy.nax_moe == "skip"
    assert settings.cluster.wires == 2  # untouched keys of the file stay
    assert load_settings(path, {"policy": {"nax_moe": "auto"}}).policy.nax_moe == "auto"


def test_speculative_depth_auto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[speculative]\ndepth = "auto"\n')
    assert load_settings(path).speculative.depth == "auto"
    monkeypatch.setenv("MLXSERVE_SPECULATIVE__DEPTH", "2")
    assert load_settings(path).speculative.depth == 2
    assert load_settings(path, {"speculative": {"depth": "auto"}}).speculative.depth == "auto"


def test_simulated_ranks_as_strings_and_tables(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[cluster]\nsimulate = ["Apple M3 Ultra", {chip = "Apple M5 Max", macos = "26.1"}]\n'
    )
    simulate = load_settings(path).cluster.simulate
    assert simulate[0] == "Apple M3 Ultra"
    assert getattr(simulate[1], "macos", None) == "26.1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[policy]\nnax_mo = "full"\n', r"c\.toml: unknown key 'policy\.nax_mo'$"),
        ("colour = 1\n", r"c\.toml: unknown key 'colour'$"),
        ('[policy]\nnax_moe = "fast"\n', r"c\.toml: invalid value for 'policy\.nax_moe'"),
        ('[cluster]\nwires = "two"\n', r"c\.toml: invalid value for 'cluster\.wires'"),
        ("[cluster]\nwires = -1\n", r"c\.toml: invalid value for 'cluster\.wires'"),
        ("[cluster\n", r"c\.toml: not valid TOML"),
        ('[speculative]\ndepth = "fast"\n', r"c\.toml: invalid value for 'speculative\.depth'"),
        ("[speculative]\ndepth = 6\n", r"c\.toml: invalid value for 'speculative\.depth'"),
        (
            "[cluster]\nsplit = [3, 0]\n",
            r"c\.toml: invalid value for 'cluster\.split': .*one whole share >= 1 per rank",
        ),
        ('[cluster]\nsplit = "3:1"\n', r"c\.toml: invalid value for 'cluster\.split'"),
        (
            '[cluster]\nsimulate = ["cpu", "cpu"]\nsplit = [1, 1, 2]\n',
            r"c\.toml: invalid value for 'cluster': .*3 shares for 2 ranks \(simulate\)",
        ),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message) as info:
        load_settings(path)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="config file not found"):
        load_settings(tmp_path / "nope.toml")


def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXSERVE_POLICY__NAX_MOE", "fast")
    with pytest.raises(UsageError, match="MLXSERVE_POLICY__NAX_MOE"):
        load_settings(None)


def test_list_variable_that_is_not_json_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXSERVE_POLICY__OVERRIDES", "nax_moe=full")
    with pytest.raises(UsageError, match=r"^MLXSERVE_POLICY__OVERRIDES: .*written as JSON"):
        load_settings(None)
    monkeypatch.setenv("MLXSERVE_POLICY__OVERRIDES", '["nax_moe=full"]')
    assert load_settings(None).policy.overrides == ["nax_moe=full"]


def test_environment_value_that_beats_the_file_is_named_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[policy]\nnax_moe = "skip"\n[server]\nport = 8001\n')
    monkeypatch.setenv("MLXSERVE_POLICY__NAX_MOE", "fast")
    with pytest.raises(UsageError, match=r"^MLXSERVE_POLICY__NAX_MOE: invalid value for"):
        load_settings(path)
    monkeypatch.delenv("MLXSERVE_POLICY__NAX_MOE")
    monkeypatch.setenv("MLXSERVE_SERVER", '{"port": -1}')
    with pytest.raises(UsageError, match=r"^MLXSERVE_SERVER: invalid value for 'server.port'"):
        load_settings(path)
    monkeypatch.delenv("MLXSERVE_SERVER")
    path.write_text("[server]\nport = -1\n")
    with pytest.raises(UsageError, match=rf"^{path}: invalid value for 'server.port'"):
        load_settings(path)
    with pytest.raises(UsageError, match=r"^command line: invalid value for 'server.port'"):
        load_settings(path, {"server": {"port": 70000}})


# -- config.toml documents every setting -------------------------------------------------

_KEY_LINE = re.compile(r"^#?\s*([a-z_]+)\s*=")
_SECTION_LINE = re.compile(r"^#?\s*\[\[?([a-z_.]+)\]\]?\s*(#.*)?$")


def _setting_paths(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    """Dotted paths of every field the settings model accepts: a model-typed field is a
    section, a list of models (``[[fallback]]``) is a section of array tables."""
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        annotation = field.annotation
        inner = get_args(annotation)[0] if get_origin(annotation) is list else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _setting_paths(annotation, path)
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            yield from _setting_paths(inner, path)
        else:
            yield path


def _documented_keys(text: str) -> set[tuple[str, ...]]:
    """(section..., key) of every key in config.toml, set or commented out, that has a
    comment of its own: on its line, or in the lines of its block above it."""
    found: set[tuple[str, ...]] = set()
    section: tuple[str, ...] = ()
    block: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            block = []
            continue
        header = _SECTION_LINE.match(line)
        if header and "=" not in line:
            section = tuple(header.group(1).split("."))
            block = []
            continue
        key = _KEY_LINE.match(line)
        explained = any(not _KEY_LINE.match(prior) for prior in block) or "# " in line.lstrip("#")
        if key and explained:
            found.add((*section, key.group(1)))
        block.append(line)
    return found


def test_config_toml_documents_every_setting() -> None:
    documented = _documented_keys((REPO / "config.toml").read_text(encoding="utf-8"))
    missing = [".".join(path) for path in _setting_paths(Settings) if path not in documented]
    assert not missing, (
        "settings that config.toml does not document (a key, or a commented-out key, in its "
        "section with a comment): " + ", ".join(missing)
    )


def test_the_documentation_check_sees_a_missing_key() -> None:
    text = "[server]\n# Where to listen.\nhost = '127.0.0.1'\n\nport = 1\n"
    assert _documented_keys(text) == {("server", "host")}
