"""A step: what the model runs next, as a small record every rank can follow.

The scheduler chooses each step (`Scheduler.next_step`), the runner runs it. It
is called a step, not a plan: a plan is the policy's (`mlxserve.policy.plan.Plan`),
the decisions an engine starts with; a step is one forward's worth of work.
In tensor parallelism rank 0 chooses and broadcasts the step; the other ranks
run the same forward. A step is plain data with a JSON form (never pickle).
"""

import json
from dataclasses import asdict, dataclass
from typing import Literal

StepKind = Literal["prefill", "decode", "speculate"]


@dataclass(frozen=True)
class Step:
    index: int
    kind: StepKind
    request_ids: tuple[str, ...]
    # prefill: prompt tokens in this chunk; decode: 1; speculate: drafts to verify
    num_tokens: int

    def same_step(self, other: "Step") -> bool:
        """The same step, but for the number of drafts of a speculative one (an
        automatic depth is chosen from one rank's timings; the others take it)."""
        if self.kind == other.kind == "speculate":
            return (self.index, self.request_ids) == (other.index, other.request_ids)
        return self == other

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Step":
        raw = json.loads(data)
        return cls(
            index=int(raw["index"]),
            kind=raw["kind"],
            request_ids=tuple(raw["request_ids"]),
            num_tokens=int(raw["num_tokens"]),
        )
