"""One request's life inside the engine: where its prompt is, what it generated.

`RequestState` is the engine's record of a request it admitted: its phase, its
model state (caches), its random keys and its speculative depth. Variables that
hold one are named ``sequence`` (a request's token sequence, as it grows).
"""

from dataclasses import dataclass, field
from enum import Enum

import mlx.core as mx

from mlxserve.engine.core.request import FinishReason, GenerationRequest, SpeculativeStats
from mlxserve.engine.runner.adapter import ModelState
from mlxserve.engine.sample.logits import TokenChooser
from mlxserve.engine.sample.sampling import Draws, KeyStream


class Phase(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclass
class RequestState:
    request: GenerationRequest
    keys: KeyStream
    depth: int
    phase: Phase = Phase.WAITING
    state: ModelState | None = None
    # prompt tokens already in `state` (from the prefix cache or prefilled)
    prefilled: int = 0
    cached_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    # Every token the runner produced for it, stop token included: what its caches saw.
    transcript: list[int] = field(default_factory=list)
    # The next token, sampled but not yet emitted (lazy: decode is pipelined).
    pending: mx.array | None = None
    finish_reason: FinishReason | None = None
    cancelled: bool = False
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    #: Set for requests whose tokens it chooses (`GenerationRequest.needs_chooser`).
    chooser: TokenChooser | None = None
    #: Positions its caches can roll back: the engine's depth even when this one does not
    #: draft, since its final state goes to the prefix cache for requests that do.
    rollback: int = 0
    # The depth is chosen per round (`mlxserve.engine.spec.depth`); `depth` is its ceiling.
    auto: bool = False
    # plain steps since the last speculative round (an automatic depth probes again)
    plain_streak: int = 0
    # the automatic depth in use (None: none chosen yet)
    chosen_depth: int | None = None
    # far probes of depth 1 since it last chose to draft (`DepthPicker.pick`'s ``probes``)
    probes: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.params.prompt_ids

    @property
    def prompt_remaining(self) -> int:
        """Prompt tokens still to prefill, keeping the last one for the first logits step."""
        return len(self.prompt) - 1 - self.prefilled

    @property
    def budget(self) -> int:
        return self.request.params.max_tokens - len(self.generated)

    def key(self, ahead: int = 0) -> mx.array:
        """The random key of the token ``ahead`` positions past those produced so far
        (``transcript``; 1: past a pending one): a token's key is its position's,
        whatever step draws it (`mlxserve.engine.sample.sampling`)."""
        return self.keys.key(len(self.transcript) + ahead)

    def draws(self, ahead: int = 0) -> Draws:
        """The keys of the positions from ``ahead`` past those produced so far on (a
        speculative round's)."""
        return self.keys.at(len(self.transcript) + ahead)
