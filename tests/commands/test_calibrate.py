"""`mlxserve policy calibrate`: a real calibration of the demo model, read by the next plan."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlxserve.cli import main
from mlxserve.policy.calibration import CalibrationRecord
from mlxserve.policy.calibration_store import SUBDIR

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLXSERVE_SERVER__STATE_DIR", str(tmp_path))
    for name in ("MLX_RANK", "MLX_HOSTFILE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _records(state_dir: Path) -> list[Path]:
    return sorted((state_dir / SUBDIR).glob("*.json")) if (state_dir / SUBDIR).is_dir() else []


def test_demo_calibration_feeds_the_plan(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policy", "calibrate", "--chunk", "256", "--chunk", "128", "--repeats", "1"]) == 0
    out, err = capsys.readouterr()
    assert "Calibrating MoE variants" in err  # the progress bar, on stderr
    (path,) = _records(state_dir)
    assert f"calibration record: {path}" in out
    record = CalibrationRecord.model_validate_json(path.read_bytes())
    # The demo: 8 experts, top-2, K 128 -> N 64, 4-bit affine groups of 32.
    assert [(s.kind, s.tokens) for s in record.shapes] == [
        ("prefill", 128),
        ("decode", 16),  # engine.max_running rows
        ("prefill", 256),
    ]
    shape = record.shapes[0]
    assert (shape.experts, shape.top_k, shape.in_dims, shape.out_dims) == (8, 2, 128, 64)
    assert (shape.bits, shape.group_size, shape.mode, record.dtype) == (4, 32, "affine", "float32")
    assert record.clock == "process"  # a CPU device: this process's CPU time, not wall time
    for timing in record.shapes:
        assert [r.variant for r in timing.results] == ["skip", "full"]
        assert all(r.error is None and r.seconds and r.max_abs_diff == 0.0 for r in timing.results)
    verdict = record.verdict()
    assert verdict is not None

    assert main(["policy", "explain", "--json"]) == 0
    decision = json.loads(capsys.readouterr().out)["ranks"][0]["decisions"]["nax_moe"]
    assert decision["rule"] == "moe-calibrated-fastest"
    assert decision["value"] == ("off" if verdict.variant == "skip" else verdict.variant)
    assert f"(calibrated {record.created_at[:10]})" in decision["reason"]


def test_ctrl_c_writes_nothing(state_dir: Path) -> None:
    """A real SIGINT once the progress bar is up: exit 130, one line, no record."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mlxserve", "policy", "calibrate", "--chunk", "65536"]
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # A runner that ignores SIGINT (a background job) would pass that on.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert process.stderr is not None
        first = process.stderr.read(1)  # the bar's first byte: measuring has begun
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    assert (first + err).decode().splitlines()[-1] == (
        "mlxserve: calibration interrupted; no record written"
    )
    assert out == b""
    assert _records(state_dir) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeats", "0"], "argument --repeats: must be >= 1, not 0"),
        (["--budget", "soon"], "argument --budget: not a number: 'soon'"),
        (["--model", "/no/such/model"], "model '/no/such/model': no such model directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    state_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    try:
        code = main(["policy", "calibrate", "--quiet", *args])
    except SystemExit as exc:  # argparse's errors exit from inside the parser
        code = int(str(exc.code))
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert _records(state_dir) == []
