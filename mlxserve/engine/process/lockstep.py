"""Keep every rank's engine in step with rank 0's, for tensor parallelism.

Under tensor parallelism every rank runs the same forward on its shard, so every
rank must run the same steps on the same tokens. Rank 0 alone talks to clients:
before each step it broadcasts what changed since the last one (requests admitted,
with a concrete seed so sampling agrees; cancellations) and the step it chose.
The other ranks apply the same changes to their own engine, ask their own scheduler
for the next step, and check that it is rank 0's: the scheduler is deterministic,
so a difference means the ranks diverged, and they stop rather than compute
garbage. Every rank then runs the step; the sharded model's collectives (all_sum)
make their logits, and so their tokens, identical.

Rank 0's warm-up (`mlxserve.engine.process.warmup`) runs through this path too, so every
rank compiles the same kernels and calibrates the automatic depth in the same
step. Its steps are marked (`warm_up`): a follower's watchdog then allows them the
warm-up's time. The first step after it says the warm-up is over
(`warm_up_over`), and the followers forget it as rank 0 did, before that step's
admissions: a prefix-cache entry kept on one rank only would change its steps.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from mlxserve.channel.messages import Generate
from mlxserve.cluster.broadcast import broadcast_bytes
from mlxserve.engine.core.request import GenerationRequest
from mlxserve.engine.core.step import Step
from mlxserve.engine.spec.costs import RoundCosts

log = logging.getLogger(__name__)


class Diverged(RuntimeError):
    """A follower's scheduler chose a different step than rank 0's."""


@dataclass
class StepMessage:
    """What rank 0 broadcasts before a step (or to stop the followers)."""

    submitted: list[GenerationRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    step: Step | None = None
    stop: bool = False
    # The step is one of rank 0's warm-up (it may compile for long).
    warm_up: bool = False
    # Rank 0's warm-up is over: forget it before the changes of this message.
    warm_up_over: bool = False
    # The step calibrates the automatic depth and rank 0 starts from these stored
    # costs: the followers take them too and measure nothing (None: all measure).
    round_costs: RoundCosts | None = None

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "submitted": [r.as_generate().model_dump() for r in self.submitted],
                "cancelled": self.cancelled,
                "step": json.loads(self.step.to_json()) if self.step else None,
                "stop": self.stop,
                "warm_up": self.warm_up,
                "warm_up_over": self.warm_up_over,
                "round_costs": self.round_costs.as_dict() if self.round_costs else None,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> StepMessage:
        raw = json.loads(data)
        step = Step.from_json(json.dumps(raw["step"]).encode()) if raw["step"] else None
        return cls(
            submitted=[GenerationRequest.of(Generate.model_validate(r)) for r in raw["submitted"]],
            cancelled=[str(c) for c in raw["cancelled"]],
            step=step,
            stop=bool(raw["stop"]),
            warm_up=bool(raw["warm_up"]),
            warm_up_over=bool(raw["warm_up_over"]),
            round_costs=RoundCosts.from_dict(raw["round_costs"])
            if raw.get("round_costs")
            else None,
        )


class LockstepLeader:
    """Rank 0's side: collects the changes before a step and broadcasts them with it."""

    def __init__(self, group: Any) -> None:
        if group.rank() != 0:
            raise ValueError("the lockstep leader runs on rank 0")
        self.group = group
        self._message = StepMessage()

    def admitted(self, request: GenerationRequest) -> None:
        self._message.submitted.append(request)

    def cancelled(self, request_id: str) -> None:
        self._message.cancelled.append(request_id)

    def warm_up_over(self) -> None:
        """Rank 0 forgot its warm-up: the followers will, with the next step."""
        self._message.warm_up_over = True

    def send_round_costs(self, costs: RoundCosts | None) -> None:
        """The next step calibrates from ``costs`` (rank 0's stored ones), or measures."""
        self._message.round_costs = costs

    def publish(self, step: Step, warm_up: bool = False) -> None:
        """Broadcast the changes since the last step, and ``step`` (a warm-up's step
        when ``warm_up``).

        Changes with no step after them (a cancellation that leaves nothing to run,
        the end of the warm-up) wait for the next step: the scheduler chose nothing
        in between, so the followers reach the same state by applying them just
        before it. So the broadcast is always inside a step, which the watchdog sees.
        """
        message, self._message = self._message, StepMessage()
        message.step = step
        message.warm_up = warm_up
        broadcast_bytes(self.group, message.to_bytes())

    def stop(self) -> None:
        broadcast_bytes(self.group, StepMessage(stop=True).to_bytes())


def follow(engine: Any, group: Any, max_messages: int | None = None) -> int:
    """A follower rank's loop: mirror rank 0's engine until it says stop.

    Returns the number of steps run. Raises ``Diverged`` when this rank's scheduler
    disagrees with rank 0's step. ``engine.warming_up`` follows rank 0's marks, for
    this rank's watchdog.
    """
    steps = 0
    received = 0
    warm_up_steps = 0
    while max_messages is None or received < max_messages:
        message = StepMessage.from_bytes(broadcast_bytes(group, None))
        received += 1
        # As rank 0 does before it takes in work (`Engine.run_once`); a warm-up's are
        # cleared with its prefix cache just below, as on rank 0.
        engine.keep_finished()
        if message.stop:
            break
        if message.warm_up_over:
            engine.forget_warm_up()
            log.info("warm-up over (%d steps with rank 0); forgotten, as on rank 0", warm_up_steps)
        if message.warm_up and not engine.warming_up:
            log.info("warm-up: following rank 0's")
        engine.warming_up = message.warm_up
        warm_up_steps += message.warm_up
        for request in message.submitted:
            engine.admit_mirrored(request)
        for request_id in message.cancelled:
            engine.cancel_now(request_id)
        step = engine.scheduler.next_step()
        if step is not None and message.step is not None and step.same_step(message.step):
            # An automatic depth is chosen from rank 0's timings: its drafts count.
            step = message.step
        if step != message.step:
            raise Diverged(f"rank {group.rank()} chose {step}, rank 0 {message.step}")
        if step is not None:
            engine.leader_costs = message.round_costs  # rank 0 decides: stored or measured
            engine.run_step(step)
            steps += 1
    return steps
