"""CI's short soak: `benchmarks/soak.py` against a live server with a standby.

Random faults of every kind while the rotation runs (21 s; 5 s at the end for the
last incident, should a slow machine need them): engine faults (kill, hang, crash,
both backends down) and what only looks like a hang (a paused front, huge prompts,
clients that do not read). No request may be lost, every greedy answer must equal
the undisturbed one, and every incident must be one an engine fault explains.

(Timings are reported by the benchmark, never asserted here.)
"""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run_soak(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/soak.py", *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["faults"], "no fault was injected"
    assert report["lost"] == 0, report["lost_detail"]
    assert report["completed"] == report["sent"] > 0
    assert report["exact_rate"] == 1.0, report
    assert report["server_exit_code"] == 0
    return report


def test_short_soak_loses_nothing_and_blames_nobody_falsely(tmp_path: Path) -> None:
    """Every kind of fault drawn; with seed 1 a hang comes 0.6 s in, the front itself is
    paused 5 s from 1.1 s, then huge prompts, hangs, kills and both backends down."""
    report = run_soak(
        tmp_path,
        *("--minutes", "0.35", "--fault-every-s", "4", "--seed", "1", "--settle-s", "5"),
    )
    kinds = {f["kind"] for f in report["faults"]}
    assert kinds & {"kill", "hang", "crash", "both_down"}, report["faults"]
    assert kinds & {"nonreader", "slow_reader", "huge_prompt", "front_pause"}, report["faults"]
    assert report["incidents"] >= 1 and report["failovers"] >= 1
    assert report["false_incidents"] == 0, report
    for fault in report["faults"]:
        if fault["kind"] == "huge_prompt":
            assert fault["outcome"].startswith("400"), fault
        elif fault["kind"] == "slow_reader":
            assert fault["outcome"] == "completed", fault
