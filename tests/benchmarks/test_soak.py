"""CI's short soak: `benchmarks/soak.py` against a live server with a standby.

Random kill, hang and crash faults on the primary while the rotation runs (21 s;
with seed 1 the first fault, a hang, comes 0.9 s in, so every run sees an incident
and a failover; 5 s at the end for its incident, should a slow machine need them):
no request may be lost, and every greedy answer must equal the undisturbed one.
(Timings are reported by the benchmark, never asserted here.)
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [sys.executable, "benchmarks/soak.py", "--minutes", "0.35", "--fault-every-s", "6"]
    result = subprocess.run(
        [*command, "--seed", "1", "--settle-s", "5", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["faults"], "no fault was injected"
    assert report["lost"] == 0, report["lost_detail"]
    assert report["completed"] == report["sent"] > 0
    assert report["exact_rate"] == 1.0, report
    assert report["server_exit_code"] == 0
    assert report["incidents"] >= 1 and report["failovers"] >= 1
