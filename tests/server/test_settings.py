"""[server] and [[fallback]] settings: defaults, file, environment, one-line errors."""

from pathlib import Path

import pytest

from mlxserve.config import load_settings
from mlxserve.errors import UsageError
from mlxserve.server.runtime import engine_env, inherited_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("MLXSERVE_"):
            monkeypatch.delenv(name)


def test_defaults_bind_loopback() -> None:
    server = load_settings(REPO / "config.toml").server
    assert (server.host, server.port) == ("127.0.0.1", 8000)
    assert server.api_keys == []


def test_fallbacks_from_the_file_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[server]\nport = 9000\n[[fallback]]\nmodel = "demo"\npolicy = ["progress_timeout_s=5"]\n'
        '[[fallback]]\nurl = "http://127.0.0.1:8001/v1"\n'
    )
    monkeypatch.setenv("MLXSERVE_SERVER__HOST", "0.0.0.0")
    settings = load_settings(path)
    assert (settings.server.host, settings.server.port) == ("0.0.0.0", 9000)
    assert [f.model for f in settings.fallback] == ["demo", None]
    assert settings.fallback[1].url == "http://127.0.0.1:8001/v1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[fallback]]\nname = 'x'\n", r"exactly one of 'model' \(local\) or 'url' \(remote\)"),
        ("[server]\nport = 70000\n", "invalid value for 'server.port'"),
        ("[server]\nprot = 1\n", "unknown key 'server.prot'"),
        ("[[fallback]]\nurl = 'notaurl'\n", "'notaurl' is not an http:// or https:// address"),
        ("[[fallback]]\nurl = 'http://h:99999/v1'\n", "Port out of range"),
    ],
)
def test_bad_server_settings_are_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        load_settings(path)


def test_engine_env_hands_over_resolved_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXSERVE_POLICY__OVERRIDES", '["progress_timeout_s=9"]')
    monkeypatch.setenv("MLXSERVE_CACHE_DIR", "/tmp/cache")
    settings = load_settings(None)
    env = engine_env(settings, "other-model", ["progress_timeout_s=2"])
    assert env["MLXSERVE_MODEL"] == "other-model"
    assert '"progress_timeout_s=2"' in env["MLXSERVE_POLICY"]
    inherited = inherited_env()
    assert "MLXSERVE_POLICY__OVERRIDES" not in inherited  # would override the fallback's own
    assert inherited["MLXSERVE_CACHE_DIR"] == "/tmp/cache"
