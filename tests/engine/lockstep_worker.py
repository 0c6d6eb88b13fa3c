"""One rank of the lockstep check, run by ``test_lockstep``: the demo model sharded over
the ring group, rank 0's engine leading, the others following its steps.

Rank 0 first runs the same requests on the whole (unsharded) model for reference.
Every rank prints one JSON line: its tokens per request (and rank 0 the reference).
Usage: ``python -m tests.engine.lockstep_worker CHECKPOINT_DIR`` under MLX_RANK/MLX_HOSTFILE.
"""

import json
import sys

import mlx.core as mx

from mlxserve.channel.request import GenerationParams, SamplingParams
from mlxserve.engine.core.build import adapter_for
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.stepper import Engine, EngineConfig, RequestStream
from mlxserve.engine.process.lockstep import LockstepLeader, follow
from mlxserve.models import load, sharded_load
from tests.engine.drive import collect

PROMPT = tuple(range(10, 60))
REQUESTS = [
    GenerationRequest("greedy-mtp", GenerationParams(PROMPT, 24), speculative_depth=3),
    GenerationRequest("greedy", GenerationParams(PROMPT[5:], 24), speculative_depth=0),
    GenerationRequest(
        "seeded",
        GenerationParams(PROMPT[:30], 24, SamplingParams(0.8, 0.95, 5)),
        speculative_depth=0,
    ),
    GenerationRequest(
        "unseeded", GenerationParams(PROMPT[:20], 24, SamplingParams(1.0)), speculative_depth=2
    ),
    GenerationRequest("cancelled", GenerationParams(PROMPT, 200), speculative_depth=0),
]
CONFIG = EngineConfig(max_running=8, prefill_step=16, speculative_depth=3)
MAX_STEPS = 2000


def drain(stream: RequestStream) -> dict[str, object]:
    tokens, finish = collect(stream, timeout=5)
    return {"tokens": tokens, "finish": finish.finish_reason}


def lead(engine: Engine, leader: LockstepLeader) -> dict[str, RequestStream]:
    streams = {r.request_id: engine.submit(r) for r in REQUESTS}
    cancelled = False
    for _ in range(MAX_STEPS):
        victim = engine.scheduler.find("cancelled")
        if not cancelled and victim is not None and len(victim.generated) >= 5:
            engine.cancel("cancelled")
            cancelled = True
        if not engine.run_once() and engine.scheduler.idle:
            break
    leader.stop()
    return streams


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    path = sys.argv[1]
    report: dict[str, object] = {"rank": group.rank(), "size": group.size()}
    if group.rank() == 0:
        whole = load(path)[0]
        reference = Engine(adapter_for(whole, 3), CONFIG)
        streams = {r.request_id: reference.submit(r) for r in REQUESTS[:3]}
        for _ in range(MAX_STEPS):
            if not reference.run_once():
                break
        report["reference"] = {rid: drain(s) for rid, s in streams.items()}
    model = sharded_load(path, group)[0]
    if group.rank() == 0:
        leader = LockstepLeader(group)
        streams = lead(Engine(adapter_for(model, 3), CONFIG, lockstep=leader), leader)
    else:
        engine = Engine(adapter_for(model, 3), CONFIG)
        streams = {}
        admit = engine.admit_mirrored

        def admit_and_keep(request: GenerationRequest) -> None:
            admit(request)
            streams[request.request_id] = engine.mirrored[request.request_id]

        engine.admit_mirrored = admit_and_keep  # type: ignore[method-assign]
        report["steps"] = follow(engine, group, max_messages=MAX_STEPS)
        report["mirrored_left"] = len(engine.mirrored)  # finished requests are freed
    report["results"] = {rid: drain(s) for rid, s in streams.items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
