"""A watchdog on every rank: a follower blocked in a collective that never completes exits 75.

Two real ring ranks on loopback, started as `mlx.launch` starts them: rank 0 is
`mlxserve serve` (its engine process leads), rank 1 follows. Rank 0's engine
hangs at a step after broadcasting it (injected), so rank 1 runs that step and
blocks in the forward's all_sum, which never completes. Both ranks must end
with exit 75 within the progress timeout + 2 s of the hang, each dumping its
stacks.
"""

import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.ring import served_by_two_ranks

pytestmark = pytest.mark.slow

PROGRESS_TIMEOUT_S = 2.0
HANG_STEP = 4  # step 1 is the health probe, 2 the prefill, then decode steps
CONFIG = f"""
model = "demo"
[policy]
overrides = ["progress_timeout_s={PROGRESS_TIMEOUT_S}"]
[server]
port = 0
ready_interval_s = 60.0
hang_floor_s = 30.0
engine_env = {{ MLXSERVE_FAULT_HANG_AT_STEP = "{HANG_STEP}" }}
"""


def logged_at(line: str) -> float:
    """The wall time of a log line that starts with `YYYY-MM-DD HH:MM:SS,mmm`."""
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def test_follower_stuck_in_a_collective_exits_75_like_rank_0(tmp_path: Path) -> None:
    with served_by_two_ranks(tmp_path, CONFIG) as (front, follower):
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": "Python reference: for"}],
            "max_tokens": 16,
            "temperature": 0,
        }
        # The only backend dies mid-request: 503 once the retries run out.
        answer = httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=2 * 60)
        assert answer.status_code == 503, answer.text
        follower.wait(timeout=30)
        follower_gone = time.time()
        _, err = follower.communicate(timeout=10)
        # Both ranks stall at step 4 together, so their watchdogs race. Usually the
        # follower's fires while it waits in the all_sum: exit 75 with its dump. If
        # rank 0's fires first, its exit breaks the follower's collective ("peer was
        # lost") and the follower ends on that instead; either way no rank is left.
        if follower.returncode == 75:
            assert "watchdog: no progress" in err and "stuck step: index=4" in err
            assert "Current thread" in err or "Thread 0x" in err  # faulthandler's dump
        else:
            assert follower.returncode != 0 and "peer was lost" in err, err[-3000:]
        hang = next(line for line in front.lines if "injected hang at step" in line)
        hung_at = logged_at(hang)
        _, detail = front.ready()
        exits = [i for i in detail["incidents"] if i["exit_code"] == 75]
        assert exits, front.tail()
        assert exits[0]["at"] - hung_at <= PROGRESS_TIMEOUT_S + 2.0, (exits, hang)
        assert follower_gone - hung_at <= PROGRESS_TIMEOUT_S + 2.0, (follower_gone, hang)
