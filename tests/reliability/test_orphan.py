"""An engine-like child stops when its parent dies (the front was killed with -9)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import sys, threading
    from mlxserve.reliability.orphan import watch_parent
    stopped = threading.Event()
    watch_parent(stopped.set, interval_s=0.05)
    print("ready", flush=True)
    sys.exit(0 if stopped.wait(30) else 1)
    """
)

PARENT = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True,
                             stdout=open(sys.argv[2], "w"))
    print(child.pid, flush=True)
    child.wait()
    """
)


@pytest.mark.slow
def test_child_stops_when_parent_is_killed(tmp_path: Path) -> None:
    out = tmp_path / "child.out"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(out)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child_pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while "ready" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=10)
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break  # gone (reaped by init)
        assert time.monotonic() < deadline, "orphaned child kept running"
        time.sleep(0.05)
