"""DeepSeek-V4.1 over 2 real ring ranks on loopback, from a published-layout checkpoint.

``sharded_load`` of a V4.1 checkpoint (Engram layers, and a DSpark head) must give
the whole model's logits at prefill and in cached decode steps, and each rank must
hold the bytes the loader's memory check counted for it from the headers
(``deepseek_v41.memory.weight_bytes``: what docs/deepseek-v4-flash.md's V4.1 memory
per rank comes from).
"""

import json
import sys
from pathlib import Path

import pytest

from tests.models.v41_fixtures import write_v41
from tests.ring import run_ring_ranks

REPO = Path(__file__).resolve().parents[2]
WORKER = [sys.executable, "-m", "tests.torchless_run", "tests.models.tp_worker_v41"]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("dspark", [False, True], ids=["engram", "engram-dspark"])
def test_sharded_v41_matches_the_whole_model(dspark: bool, tmp_path: Path) -> None:
    directory = write_v41(tmp_path / "v41", engram=True, dspark=dspark)
    env = {"OMP_NUM_THREADS": "1"}
    runs = run_ring_ranks([*WORKER, str(directory)], [env] * 2, tmp_path, timeout=120, cwd=REPO)
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    reports = [json.loads(run.stdout.strip().splitlines()[-1]) for run in runs]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["size"] == 2 and report["engram_layers"] == [1, 3], report
        tolerance = 1e-4 * max(report["scale"], 1.0)
        assert report["prefill"] <= tolerance and report["decode"] <= tolerance, report
        assert report["prefill_tokens"] == 0 and report["decode_tokens"] == 0, report
        assert report["counted_bytes"] == report["held_bytes"], report
