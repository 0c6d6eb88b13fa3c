"""Tensor-parallel serving in lockstep: rank 0 broadcasts each step plan, the others follow.

Two real ring ranks on loopback, each holding half of the demo model: the follower
produces exactly rank 0's tokens (greedy, MTP speculative, seeded and unseeded
sampling, a cancellation), and the greedy ones equal the unsharded model's.
"""

import json
import sys
from pathlib import Path

import pytest
from mlx.nn.layers.base import Module

from mlxserve.engine.adapter import PlainAdapter
from mlxserve.engine.engine import Engine, EngineConfig
from mlxserve.engine.lockstep import StepMessage
from mlxserve.engine.request import GenerationRequest, SamplingParams
from mlxserve.engine.step_plan import StepPlan
from tests.engine.drive import run as run_engine
from tests.ring import run_ring_ranks

REPO = Path(__file__).resolve().parents[2]


def test_step_message_round_trip() -> None:
    request = GenerationRequest(
        "r", (1, 2, 3), 8, SamplingParams(0.5, 0.9, 7), frozenset({5}), speculative_depth=2
    )
    message = StepMessage([request], ["gone"], StepPlan(4, "decode", ("r", "s"), 1))
    assert StepMessage.from_bytes(message.to_bytes()) == message
    assert StepMessage.from_bytes(StepMessage(stop=True).to_bytes()).stop


def test_rank_0_publishes_inside_the_watched_step(llama_model: Module) -> None:
    """A follower that never answers must look like a stalled step to the watchdog."""
    seen: list[bool] = []

    class Recorder:
        def admitted(self, request: GenerationRequest) -> None:
            assert request.sampling.seed is not None  # the seed travels with the request

        def cancelled(self, request_id: str) -> None:
            pass

        def publish(self, plan: StepPlan) -> None:
            seen.append(engine.current_step == plan)

    engine = Engine(PlainAdapter(llama_model), EngineConfig(), lockstep=Recorder())  # type: ignore[arg-type]
    run_engine(engine, GenerationRequest("a", (1, 2, 3), 4, SamplingParams(1.0)))
    assert seen and all(seen)


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
    assert follower["mirrored_left"] == 0
    results = leader["results"]
    assert results["cancelled"]["finish"] == "cancelled"
    assert 0 < len(results["cancelled"]["tokens"]) < 200
    assert results["unseeded"]["finish"] in ("length", "stop")
    for rid in ("greedy-mtp", "greedy", "seeded"):
        assert results[rid] == leader["reference"][rid], rid
