"""Tensor-parallel serving in lockstep: rank 0 broadcasts each step, the others follow.

Two real ring ranks on loopback, each holding half of the demo model: the follower
produces exactly rank 0's tokens (greedy, MTP speculative, seeded and unseeded
sampling, a cancellation), and the greedy ones equal the unsharded model's.
"""

import json
import sys
from pathlib import Path

import pytest
from mlx.nn.layers.base import Module

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.step import Step
from mlxserve.engine.core.stepper import Engine, EngineConfig, RequestStream
from mlxserve.engine.process import lockstep
from mlxserve.engine.process.lockstep import LockstepLeader, StepMessage, follow
from mlxserve.engine.process.warmup import warm_up
from mlxserve.engine.runner.adapter import PlainAdapter
from mlxserve.engine.spec.mtp import MTPAdapter
from tests.engine.drive import collect
from tests.engine.drive import run as run_engine
from tests.engine.v4_models import tiny_v4
from tests.ring import run_ring_ranks

REPO = Path(__file__).resolve().parents[3]


def test_step_message_round_trip() -> None:
    request = GenerationRequest(
        "r", GenerationParams((1, 2, 3), 8, SamplingParams(0.5, 0.9, 7), (5,)), speculative_depth=2
    )
    message = StepMessage([request], ["gone"], Step(4, "decode", ("r", "s"), 1))
    assert StepMessage.from_bytes(message.to_bytes()) == message
    assert StepMessage.from_bytes(StepMessage(stop=True).to_bytes()).stop
    marked = StepMessage(step=Step(0, "prefill", ("w",), 3), warm_up=True, warm_up_over=True)
    assert StepMessage.from_bytes(marked.to_bytes()) == marked


def test_rank_0_publishes_inside_the_watched_step(llama_model: Module) -> None:
    """A follower that never answers must look like a stalled step to the watchdog."""
    seen: list[bool] = []

    class Recorder:
        def admitted(self, request: GenerationRequest) -> None:
            assert request.params.sampling.seed is not None  # the seed travels with the request

        def cancelled(self, request_id: str) -> None:
            pass

        def publish(self, step: Step, warm_up: bool = False) -> None:
            seen.append(engine.current_step == step and not warm_up)

    engine = Engine(PlainAdapter(llama_model), EngineConfig(), lockstep=Recorder())  # type: ignore[arg-type]
    run_engine(engine, GenerationRequest("a", GenerationParams((1, 2, 3), 4, SamplingParams(1.0))))
    assert seen and all(seen)


class _Rank:
    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def test_followers_run_rank_0s_warm_up_and_forget_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's warm-up goes out as marked steps, the first step after it says it is
    over; a follower given those messages runs the same steps (the depth calibration
    in the same one), under the warm-up's allowance, and forgets the warm-up before
    the next request, as rank 0 did: the request's prompt is the warm-up's, so a
    prefix-cache entry left on the follower would change its steps (``Diverged``).

    In one process, the broadcast replaced by a recording: the collectives are
    ``test_two_ranks_serve_in_lockstep``'s and the live group's (tests/server)."""
    model = tiny_v4()
    config = EngineConfig(
        prefill_step=16,
        speculative_depth="auto",
        max_speculative_batch=2,
        batch_speculative_depth=2,
    )

    def adapter() -> MTPAdapter:
        shallow = MTPAdapter(model)
        shallow.max_draft_depth = 2  # a shorter calibration (it times every depth)
        return shallow

    sent: list[bytes] = []
    monkeypatch.setattr(lockstep, "broadcast_bytes", lambda _, data: sent.append(data) or data)
    leader = Engine(adapter(), config, lockstep=LockstepLeader(_Rank(0)))
    uncalibrated: list[int] = []  # the steps that began before a calibration
    leader.before_step = lambda step: (
        None if leader.depth_picker else uncalibrated.append(step.index)
    )
    prompt = tuple(range(3, 20))
    warm_up(leader, prompt)
    warm_up_steps = len(sent)
    tokens, finish = run_engine(leader, GenerationRequest("a", GenerationParams(prompt, 12)))["a"]
    assert finish.usage.cached_tokens == 0  # the warm-up's prefix entries are gone
    messages = [StepMessage.from_bytes(data) for data in sent]
    assert all(m.warm_up and not m.warm_up_over for m in messages[:warm_up_steps])
    assert messages[warm_up_steps].warm_up_over and not messages[warm_up_steps].warm_up
    assert not any(m.warm_up or m.warm_up_over for m in messages[warm_up_steps + 1 :])

    feed = iter([*sent, StepMessage(stop=True).to_bytes()])
    monkeypatch.setattr(lockstep, "broadcast_bytes", lambda _, data: next(feed))
    follower = Engine(adapter(), config)
    marks: list[bool] = []
    follower_uncalibrated: list[int] = []

    def watch(step: Step) -> None:
        marks.append(follower.warming_up)
        if follower.depth_picker is None:
            follower_uncalibrated.append(step.index)

    follower.before_step = watch
    streams: dict[str, RequestStream] = {}
    admit = follower.admit_mirrored

    def admit_and_keep(request: GenerationRequest) -> None:
        admit(request)
        streams[request.request_id] = follower.mirrored[request.request_id]

    follower.admit_mirrored = admit_and_keep  # type: ignore[method-assign]
    assert follow(follower, _Rank(1)) == len(messages)
    assert marks == [m.warm_up for m in messages]
    # Both calibrated, in the same step, a warm-up one.
    assert leader.depth_picker is not None and follower.depth_picker is not None
    assert follower_uncalibrated == uncalibrated
    last_warm_up = messages[warm_up_steps - 1].step
    assert last_warm_up is not None and uncalibrated[-1] < last_warm_up.index
    assert collect(streams["a"])[0] == tokens
    assert follower.prefix_cache is not None and leader.prefix_cache is not None
    assert len(follower.prefix_cache) == len(leader.prefix_cache)


@pytest.mark.slow
def test_two_ranks_serve_in_lockstep(tmp_path: Path) -> None:
    from mlxserve.models.demo.build import build_demo_model

    path = build_demo_model(tmp_path / "demo", progress=False)
    command = [
        sys.executable,
        "-m",
        "tests.torchless_run",
        "tests.engine.lockstep_worker",
        str(path),
    ]
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
