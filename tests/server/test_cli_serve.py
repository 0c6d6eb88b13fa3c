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
