"""What a client asks the engine for, and what the engine sends back.

These are plain records: the engine process turns them into JSON lines for
the front process, so they carry only ids, numbers and strings. What a request
asks for is the channel's record (`mlxserve.channel.request`), held unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from mlxserve.channel.messages import Generate
from mlxserve.channel.request import GenerationParams, TokenLogprob

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    """One request as the engine runs it: the front's `GenerationParams`, unchanged,
    under the request's id."""

    request_id: str
    params: GenerationParams
    # None: the engine's configured depth (0 when the model has no MTP module).
    speculative_depth: int | None = None

    @classmethod
    def of(cls, message: Generate) -> GenerationRequest:
        """The request a `generate` message asks for (the front's, or rank 0's)."""
        return cls(message.id, message.params, message.speculative_depth)

    def as_generate(self) -> Generate:
        return Generate(
            id=self.request_id, params=self.params, speculative_depth=self.speculative_depth
        )

    def with_seed(self, seed: int) -> GenerationRequest:
        """This request drawing its samples from ``seed``."""
        sampling = replace(self.params.sampling, seed=seed)
        return replace(self, params=replace(self.params, sampling=sampling))

    @property
    def needs_chooser(self) -> bool:
        """Chosen by a `TokenChooser` (`engine.logits`): a grammar, a thinking budget, a
        penalty, a filter other than top_p, or logprobs, which need each token known
        before the next one's logits are turned into a choice."""
        params = self.params
        budget = params.reasoning is not None and params.reasoning.budget_tokens is not None
        return params.grammar is not None or budget or not params.sampling.plain


@dataclass
class SpeculativeStats:
    """Per request: drafts proposed and accepted, in total and per draft position, and
    how many steps ran at each depth (0: a plain step, when the depth is automatic)."""

    depth: int | str = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at_depth: list[int] = field(default_factory=list)
    accepted_at_depth: list[int] = field(default_factory=list)
    # rounds in which position j was drafted and every draft before it was kept
    reached_at_depth: list[int] = field(default_factory=list)
    steps_at_depth: dict[int, int] = field(default_factory=dict)

    def record(self, drafted: int, accepted: int) -> None:
        """One draft round: `drafted` tokens proposed, the first `accepted` of them kept."""
        need = max(drafted, len(self.drafted_at_depth))
        for counts in (self.drafted_at_depth, self.accepted_at_depth, self.reached_at_depth):
            counts += [0] * (need - len(counts))
        for depth in range(drafted):
            self.drafted_at_depth[depth] += 1
            self.accepted_at_depth[depth] += int(depth < accepted)
            self.reached_at_depth[depth] += int(depth <= accepted)
        self.drafted += drafted
        self.accepted += accepted
        self.count_step(drafted)

    def count_step(self, depth: int) -> None:
        self.steps_at_depth[depth] = self.steps_at_depth.get(depth, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, object]:
        rates = [
            a / d if d else 0.0
            for a, d in zip(self.accepted_at_depth, self.drafted_at_depth, strict=True)
        ]
        return {
            "depth": self.depth,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_depth": rates,
            "depths_chosen": {str(k): n for k, n in sorted(self.steps_at_depth.items())},
        }


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class TokensEvent:
    """New tokens of one request, in order (with their logprobs when asked for)."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class FinishEvent:
    request_id: str
    finish_reason: FinishReason
    usage: Usage
    speculative: dict[str, object] | None = None
    error: str | None = None
    # The engine's memory when it finished (bytes): MLX active memory, its peak since
    # start and since the engine was last idle, the model weights, this request's share
    # of the caches and the prefix cache's bytes (for benchmarks).
    memory: dict[str, int] | None = None


Event = TokensEvent | FinishEvent
