"""Incident memory: a hang on a simulated all-NAX cluster pins its NAX ranks to `full`.

A real server on a simulated two-rank M5 Max cluster (plan: `skip`, rule
nax-moe-homogeneous-skip) whose engine hangs once (injected). The watchdog's
exit 75 is remembered in `[server] state_dir`; the restarted engine's plan is
then `full` by rule `incident-pinned`, whose reason names the incident's plan.
`mlxserve policy explain` shows the same, `policy incidents` lists the record,
and `--clear` forgets it.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxserve.reliability.incidents import IncidentStore
from tests.server.live import MODEL, REPO, LiveServer

pytestmark = pytest.mark.slow

CLUSTER = '["Apple M5 Max", "Apple M5 Max"]'


def config(state: Path) -> str:
    return f"""
model = "{MODEL}"
[policy]
overrides = ["progress_timeout_s=2"]
[cluster]
simulate = {CLUSTER}
[server]
port = 0
ready_interval_s = 30.0
restart_backoff_s = 0.2
state_dir = "{state}"
engine_env = {{ MLXSERVE_FAULT_HANG_AT_STEP = "3" }}
"""


def cli(*args: str, config_path: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "mlxserve", "policy", *args, "--config", str(config_path)],
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("MLXSERVE_")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def nax_moe(plan: dict[str, object]) -> list[tuple[object, object]]:
    ranks = plan["ranks"]
    assert isinstance(ranks, list)
    return [(r["decisions"]["nax_moe"]["value"], r["decisions"]["nax_moe"]["rule"]) for r in ranks]


def test_a_hang_pins_the_nax_ranks_of_that_cluster_to_full(tmp_path: Path) -> None:
    state = tmp_path / "state"
    live = LiveServer(tmp_path, config(state)).start()
    try:
        before = httpx.get(f"{live.url}/v1/policy", timeout=10).json()
        assert nax_moe(before) == [("skip", "nax-moe-homogeneous-skip")] * 2
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Python reference: for"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=120)  # step 3 hangs
        deadline = time.monotonic() + 60
        while True:
            _, detail = live.ready()
            plan = httpx.get(f"{live.url}/v1/policy", timeout=10).json()
            if detail["incidents"] and plan["plan_hash"] != before["plan_hash"]:
                break
            assert time.monotonic() < deadline, live.tail()
            time.sleep(0.2)
        live.wait_ready(120, active="primary")
        after = httpx.get(f"{live.url}/v1/policy", timeout=10).json()
    finally:
        assert live.stop() == 0, live.tail()
    assert detail["incidents"][0]["kind"] == "watchdog"
    assert nax_moe(after) == [("full", "incident-pinned")] * 2
    reason = after["ranks"][0]["decisions"]["nax_moe"]["reason"]
    assert before["plan_hash"][:12] in reason and "watchdog incident at" in reason

    (record,) = IncidentStore(state).load()
    assert record.plan_hash == before["plan_hash"]
    assert record.composition == "all_nax" and record.chips == ["Apple M5 Max"] * 2
    assert record.decisions["ranks"][0]["nax_moe"] == "skip"
    assert record.step_kind in ("prefill", "decode", "speculate")

    explained = cli("explain", config_path=live.config)
    assert "full [incident-pinned]" in explained and before["plan_hash"][:12] in explained
    listed = json.loads(cli("incidents", "--json", config_path=live.config))
    assert [item["plan_hash"] for item in listed] == [before["plan_hash"]]
    assert "cleared 1 incident(s)" in cli("incidents", "--clear", config_path=live.config)
    assert "skip [nax-moe-homogeneous-skip]" in cli("explain", config_path=live.config)
