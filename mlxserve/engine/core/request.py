"""What a client asks the engine for, and what the engine sends back.

These are plain records: the engine process turns them into JSON lines for
the front process, so they carry only ids, numbers and strings.
"""

from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "cancelled", "error"]


MAX_TOP_LOGPROBS = 20


class SamplingFields(Protocol):
    """The sampling fields beyond temperature, top_p and seed, wherever they travel
    (the engine's `SamplingParams`, a backend's `GenerationParams`)."""

    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]: ...
    @property
    def logprobs(self) -> int | None: ...


class Sampling(SamplingFields, Protocol):
    """All of a request's sampling fields, temperature, top_p and seed included."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...


def only_temperature_top_p(fields: SamplingFields) -> bool:
    """No field beyond temperature, top_p and seed asks for anything."""
    return (
        fields.top_k == 0
        and fields.min_p == 0
        and fields.presence_penalty == 0
        and fields.frequency_penalty == 0
        and fields.repetition_penalty == 1
        and not fields.logit_bias
        and fields.logprobs is None
    )


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_p, top_k and min_p filter the temperature-scaled
    distribution; the penalties and ``logit_bias`` change the logits before all that.

    ``logprobs``: None sends no log-probabilities; k >= 0 sends the chosen token's and
    the k most likely alternatives'.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Only temperature and top_p: what batched and speculative decoding implement."""
        return only_temperature_top_p(self)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    # None: the engine's configured depth (0 when the model has no MTP module).
    speculative_depth: int | None = None
    #: An llguidance grammar (its JSON or Lark text) every generated token must follow.
    grammar: str | None = None
    #: Tokens at the end of the prompt that are the answer so far (a resumed request):
    #: the grammar has read them and the penalties count them.
    grammar_prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    @property
    def needs_chooser(self) -> bool:
        """Chosen by a `TokenChooser` (`engine.logits`): a grammar, a penalty, a filter
        other than top_p, or logprobs, which need each token known before the next one's
        logits are turned into a choice."""
        return self.grammar is not None or not self.sampling.plain


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
class TokenLogprob:
    """A chosen token's log-probability and the most likely alternatives'."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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
