"""A tensor-parallel group as a backend: mlxserve starts it, supervises it, restarts it whole.

`[cluster] hosts` makes the front start the primary as a group of two real ring
ranks on loopback (mlx.launch's machinery, via `mlxserve.cluster.launch`), with a
single-engine standby. A `kill -9` of the follower mid-stream ends the group;
four greedy streams complete exactly on the standby; the group is started again,
becomes ready and serves.
"""

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.live import MODEL, LiveServer
from tests.server.test_failover import Stream, check_recovery, run_all

pytestmark = pytest.mark.slow

CONFIG = f"""
model = "{MODEL}"
[cluster]
hosts = ["127.0.0.1", "127.0.0.1"]
[server]
port = 0
ready_interval_s = 30.0
retry_attempts = 8
retry_backoff_s = 0.2
retry_backoff_max_s = 2.0
restart_backoff_s = 0.2
[[fallback]]
name = "standby"
model = "{MODEL}"
"""


def ranks_of(launcher: int) -> dict[int, int]:
    """The group's rank processes on this host: MLX_RANK -> pid (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) != launcher:  # the parent
            continue
        for item in environ:
            if item.startswith(b"MLX_RANK="):
                found[int(item[9:])] = int(entry.name)
    return found


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    if not Path("/proc/self/environ").exists():
        pytest.skip("finds the ranks through /proc (Linux)")
    live = LiveServer(tmp_path, CONFIG, env={"OMP_NUM_THREADS": "1"})
    try:
        yield live.start(timeout=240)
    finally:
        code = live.stop()
        assert code == 0, live.tail()


def test_kill_9_of_the_follower_restarts_the_group(server: LiveServer) -> None:
    _, detail = server.ready()
    primary = detail["backends"][0]
    assert primary["kind"] == "group"
    assert server.metric("mlxserve_backend_active", backend="primary") == 1
    killed: list[int] = []

    def kill_follower(streams: list[Stream]) -> None:
        deadline = time.monotonic() + 60
        while not all(s.chunks for s in streams) and time.monotonic() < deadline:
            time.sleep(0.01)
        ranks = ranks_of(primary["pid"])
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)
        killed.append(ranks[1])

    streams = run_all(server.url, kill_follower)
    assert killed
    for stream in streams:
        assert stream.error is None, stream.error
    assert server.metric("mlxserve_failovers_total") == 1
    assert [i["backend"] for i in server.incidents(1)] == ["primary"], server.tail()
    # The group comes back whole (both ranks new) and serves the same text.
    reference = check_recovery(server, streams)
    assert all(s.backend == "primary" for s in reference)
    _, detail = server.ready()
    assert set(ranks_of(detail["backends"][0]["pid"])) == {0, 1}
    assert killed[0] not in ranks_of(detail["backends"][0]["pid"]).values()
