"""`mlxserve --config F` means serve; bad flags and a busy port are one line and exit 2."""

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mlxserve.cli import _with_default_command

REPO = Path(__file__).resolve().parents[2]


def test_flags_without_a_command_mean_serve() -> None:
    assert _with_default_command(["--config", "c.toml"]) == ["serve", "--config", "c.toml"]
    assert _with_default_command(["probe"]) == ["probe"]
    assert _with_default_command(["--help"]) == ["--help"]
    assert _with_default_command([]) == []


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxserve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "abc"], "invalid int value: 'abc'"),
        (["serve", "--speculative-depth", "9"], "'9' is not 0-5 or 'auto'"),
        (["--config", "missing.toml"], "missing.toml: config file not found"),
        (["--policy", "foo=bar"], "policy.overrides: unknown decision"),
        (["--policy", "nax_moe@1=full"], "rank 1 does not exist (world size 1)"),
    ],
)
def test_bad_flags_are_one_line(args: list[str], message: str) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_busy_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(
            "serve", "--port", str(port), "--model", str(REPO / "mlxserve/models/demo/weights")
        )
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr.strip().splitlines()[-1]


def test_bad_fallback_policy_is_one_line_before_listening(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        '[[fallback]]\nname = "standby"\nmodel = "demo"\npolicy = ["nax_moe@3=full"]\n'
    )
    result = run("--config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "mlxserve: error: fallback 'standby': policy.overrides: rank 3 does not exist "
        "(world size 1)"
    ]


def test_engine_that_exits_2_is_not_retried_and_the_front_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[server]\nport = 0\nengine_env = { MLXSERVE_FAULT_HANG_AT_STEP = "soon" }\n')
    result = run("--config", str(config))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("MLXSERVE_FAULT_HANG_AT_STEP must be a step index") == 3
    assert "refuses to start (not retried)" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("mlxserve: error: no backend can")
    assert "retrying" not in result.stderr
