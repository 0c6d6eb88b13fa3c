"""`mlxserve demo-model`: builds the demo checkpoint, reuses it, never clobbers other data."""

import subprocess
import sys
from pathlib import Path

import pytest

from mlxserve.cli import main
from mlxserve.models import load


def test_builds_reuses_and_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    assert main(["demo-model", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert main(["demo-model", "--out", str(out), "--quiet"]) == 0
    assert weights.stat().st_mtime_ns == stamp  # Complete build: reused, not rewritten.
    model, tokenizer = load(str(out))
    assert model.num_mtp_blocks == 1 and tokenizer.eos_token_id is not None


def test_progress_bar_goes_to_stderr(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    run = subprocess.run(
        [sys.executable, "-m", "mlxserve", "demo-model", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(out)
    assert "Building demo model" in run.stderr


def test_refuses_a_directory_it_did_not_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    assert main(["demo-model", "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a demo build" in err
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert main(["demo-model", "--out", str(tmp_path / "notes.txt"), "--quiet"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_dspark_variant_loads_with_its_head_and_no_mtp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlxserve.models.deepseek_v4.dspark import head_of

    out = tmp_path / "dspark"
    assert main(["demo-model", "--dspark", "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    model, _ = load(str(out))
    head = head_of(model)
    assert model.num_mtp_blocks == 0 and head is not None and head.spec.block_size == 4
    assert main(["demo-model", "--dspark", "--deepseek-format", "--quiet"]) == 2
    assert "pick one" in capsys.readouterr().err
