"""A watchdog on every rank: no rank of a tensor-parallel group outlives a stalled step.

Two real ring ranks on loopback, started as `mlx.launch` starts them: rank 0 is
`mlxserve serve` (its engine process leads), rank 1 follows. A hang is injected
at step 4 (step 1 is the health probe, 2 the prefill, then decode steps), on one
rank, and the other waits for it in the step's collective.

- The follower stalls (``MLXSERVE_FAULT_FOLLOWER_HANG_AT_STEP``): it sleeps before
  its forward, where nothing rank 0 does can reach it, so it is its own watchdog
  that ends it, every time: exit 75 with its diagnostic and stacks.
- Rank 0 stalls (``MLXSERVE_FAULT_HANG_AT_STEP``): its engine exits 75, and the
  follower, blocked in the forward's all_sum, must be gone as soon, however it
  learns of it: its watchdog (exit 75), or the collective breaking when rank 0's
  process ends ("peer was lost"). Both stall at the same step, so which comes
  first is a race; what this case shows is that the follower is never left behind.
"""

import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.ring import served_by_two_ranks
from tests.server.live import LiveServer

pytestmark = pytest.mark.slow

PROGRESS_TIMEOUT_S = 2.0
HANG_STEP = 4
CONFIG = f"""
model = "demo"
[policy]
overrides = ["progress_timeout_s={PROGRESS_TIMEOUT_S}"]
[server]
port = 0
ready_interval_s = 60.0
hang_floor_s = 30.0
restart_wait_s = 0.0
"""
BODY = {
    "model": "demo",
    "messages": [{"role": "user", "content": "Python reference: for"}],
    "max_tokens": 16,
    "temperature": 0,
}


def logged_at(line: str) -> float:
    """The wall time of a log line that starts with `YYYY-MM-DD HH:MM:SS,mmm`."""
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def hung_at(lines: list[str]) -> float:
    return logged_at(next(line for line in lines if "injected hang at step" in line))


def fail_the_request(front: LiveServer, follower: "subprocess.Popen[str]") -> tuple[str, float]:
    """The request the stall catches (the only backend dies: 503 once the retries run
    out); then the follower's stderr and when it was seen gone."""
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=BODY, timeout=2 * 60)
    assert answer.status_code == 503, answer.text
    try:
        follower.wait(timeout=30)
    except subprocess.TimeoutExpired:  # say where each side was, not only that it waited
        follower.kill()
        _, err = follower.communicate(timeout=10)
        raise AssertionError(
            f"the follower outlived the request by 30 s:\n{err[-3000:]}\n{front.tail()}"
        ) from None
    gone = time.time()
    _, err = follower.communicate(timeout=10)
    return err, gone


def test_a_stalled_follower_exits_75_by_its_own_watchdog(tmp_path: Path) -> None:
    stall = {"MLXSERVE_FAULT_FOLLOWER_HANG_AT_STEP": str(HANG_STEP)}
    with served_by_two_ranks(tmp_path, CONFIG, follower_env=stall) as (front, follower):
        err, gone = fail_the_request(front, follower)
        assert follower.returncode == 75, err[-3000:]
        assert "this follower hangs at step 4" in err  # armed from its own environment
        assert "watchdog: no progress" in err and f"stuck step: index={HANG_STEP}" in err
        assert "run_follower" in err  # the stack is the follower loop's
        assert "Current thread" in err or "Thread 0x" in err  # faulthandler's dump
        assert gone - hung_at(err.splitlines()) <= PROGRESS_TIMEOUT_S + 2.0, err[-3000:]
        # Rank 0's engine never armed the follower's fault.
        assert not any("injected hang" in line for line in front.lines), front.tail()


def test_followers_are_gone_as_soon_as_a_stalled_rank_0(tmp_path: Path) -> None:
    stall = f'engine_env = {{ MLXSERVE_FAULT_HANG_AT_STEP = "{HANG_STEP}" }}\n'
    with served_by_two_ranks(tmp_path, CONFIG + stall) as (front, follower):
        err, gone = fail_the_request(front, follower)
        if follower.returncode == 75:  # its watchdog fired first, in the all_sum
            assert "watchdog: no progress" in err and f"stuck step: index={HANG_STEP}" in err
        else:  # rank 0's exit broke the collective first
            assert follower.returncode != 0 and "peer was lost" in err, err[-3000:]
        hang = logged_at(front.logged("injected hang at step"))  # relayed from its engine
        exits = [i for i in front.incidents(1) if i["exit_code"] == 75]
        assert exits, front.tail()
        assert exits[0]["at"] - hang <= PROGRESS_TIMEOUT_S + 2.0, (exits, hang)
        assert gone - hang <= PROGRESS_TIMEOUT_S + 2.0, (gone, hang)
