"""`mlxserve serve` on two real ring ranks: rank 0 serves HTTP, rank 1 follows.

Started the way `mlx.launch` starts them (the same command and config per rank,
MLX_RANK and MLX_HOSTFILE set), on loopback. The demo model is sharded over both
ranks. The group warms up first (forced: "auto" skips it on a CPU): rank 0's
warm-up requests run on both ranks, the depth calibration in them, and both ranks
forget them. A greedy chat completion then equals `mlxserve generate` on one
process (no warm-up there), and Ctrl-C sent to both ranks (as `mlx.launch`
forwards it) drains rank 0, whose engine then stops rank 1: both exit 0.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ring import served_by_two_ranks
from tests.server.live import REPO

pytestmark = pytest.mark.slow

PROMPT = "Python reference: assert"
CONFIG = """
model = "demo"
[engine]
warm_up = true
[server]
port = 0
ready_interval_s = 2.0
"""


def test_two_ranks_serve_one_model(tmp_path: Path) -> None:
    with served_by_two_ranks(tmp_path, CONFIG) as (front, follower):
        body = {
            "model": "demo",
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 24,
            "temperature": 0,
        }
        with front.client() as http:
            reply = http.post("/v1/chat/completions", json=body).json()
            status = http.get("/status", params={"format": "json"}).json()
        assert status["plan"]["world_size"] == 2
        single = subprocess.run(
            [sys.executable, "-m", "mlxserve", "generate", "--model", "demo", "--prompt", PROMPT,
             "--max-tokens", "24", "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        assert reply["choices"][0]["message"]["content"] == json.loads(single.stdout)["text"]
        follower.send_signal(signal.SIGINT)  # waits for rank 0's stop
        assert front.stop(signal.SIGINT) == 0, front.tail()
        _, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err[-2000:]
        assert "rank 0 stopped after" in err
        # The warm-up ran on both ranks, the calibration in it on the follower too,
        # and the follower forgot it with rank 0's first serving step.
        assert any("warm-up:" in line for line in front.lines), front.tail()
        following = err.index("warm-up: following rank 0's")
        over = err.index("warm-up over (")
        assert following < err.index("speculative round costs") < over, err[-3000:]
