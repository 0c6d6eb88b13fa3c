"""Tensor-parallel serving in lockstep: rank 0 broadcasts each step plan, the others follow.

Two real ring ranks on loopback, each holding half of the demo model: the follower
produces exactly rank 0's tokens (greedy, MTP speculative, seeded and unseeded
sampling, a cancellation), and the greedy ones equal the unsharded model's.
"""

import json
import sys
from pathlib import Path

import pytest

from mlxserve.engine.lockstep import StepMessage
from mlxserve.engine.request import GenerationRequest, SamplingParams
from mlxserve.engine.step_plan import StepPlan
from tests.ring import run_ring_ranks

REPO = Path(__file__).resolve().parents[2]


def test_step_message_round_trip() -> None:
    request = GenerationRequest(
        "r", (1, 2, 3), 8, SamplingParams(0.5, 0.9, 7), frozenset({5}), speculative_depth=2
    )
    message = StepMessage([request], ["gone"], StepPlan(4, "decode", ("r", "s"), 1))
    assert StepMessage.from_bytes(message.to_bytes()) == message
    assert StepMessage.from_bytes(StepMessage(stop=True).to_bytes()).stop


@pytest.mark.slow
def test_two_ranks_serve_in_lockstep(tmp_path: Path) -> None:
    from mlxserve.models.demo.build import build_demo_model

    path = build_demo_model(tmp_path / "demo", progress=False)
    command = [sys.executable, "-m", "tests.engine.lockstep_worker", str(path)]
    runs = run_ring_ranks(command, [{"OMP_NUM_THREADS": "1"}] * 2, tmp_path, timeout=150, cwd=REPO)
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    leader, follower = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert follower["results"] == leader["results"]
    assert follower["steps"] > 10
    results = leader["results"]
    assert results["cancelled"]["finish"] == "cancelled"
    assert 0 < len(results["cancelled"]["tokens"]) < 200
    assert results["unseeded"]["finish"] in ("length", "stop")
    for rid in ("greedy-mtp", "greedy", "seeded"):
        assert results[rid] == leader["reference"][rid], rid
