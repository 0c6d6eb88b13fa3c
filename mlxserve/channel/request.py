"""What a generation asks for, declared once, and the log-probabilities it may get back.

The API edge builds these records from a request's body (`mlxserve.server.routes`),
the router and every backend carry them unchanged, a `Generate` message nests them
on the engine socket, and the engine's request holds them up to the sampler: no
hop copies a field into a record of its own, so none can be lost on the way.

They are plain frozen dataclasses, checked when built (ValueError, with the same
message wherever one is built); pydantic reads them back from the socket's JSON
(`mlxserve.channel.messages`), running the same checks, and refuses unknown keys.
"""

from dataclasses import dataclass

from pydantic import ConfigDict, with_config

MAX_TOP_LOGPROBS = 20

_RECORD = ConfigDict(extra="forbid")


@with_config(_RECORD)
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
        """Only temperature, top_p and seed ask for anything: what batched and
        speculative decoding implement."""
        return (
            self.top_k == 0
            and self.min_p == 0
            and self.presence_penalty == 0
            and self.frequency_penalty == 0
            and self.repetition_penalty == 1
            and not self.logit_bias
            and self.logprobs is None
        )


@with_config(_RECORD)
@dataclass(frozen=True)
class Reasoning:
    """The reasoning the prompt opened (thinking mode), as the engine bounds it.

    ``end_ids``: the marker that ends the reasoning (``</think>``), as the model's
    tokens; the engine recognises it by them in the answer. ``budget_tokens``: the
    reasoning's most tokens, its end marker included: where only the marker still
    fits, the engine forces it (`mlxserve.engine.sample.ending`), and the answer
    follows. None: unbounded (the record then only tells a grammar's closing where the
    reasoning ends).
    """

    end_ids: tuple[int, ...]
    budget_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ValueError("the reasoning's end marker must have at least one token")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ValueError("budget_tokens must be >= 1")


@with_config(_RECORD)
@dataclass(frozen=True)
class GenerationParams:
    """One generation: the prompt, how much to generate, where to stop, how to sample,
    and the grammar the answer must follow."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    #: The model's end-of-sequence ids; empty: keep going past them (``ignore_eos``).
    stop_token_ids: tuple[int, ...] = ()
    #: An llguidance grammar (its JSON or Lark text) every generated token must follow
    #: (`mlxserve.server.constraints` writes them).
    grammar: str | None = None
    #: Tokens at the end of the prompt that are the answer so far (a resumed request):
    #: the grammar has read them and the penalties count them.
    grammar_prefix: tuple[int, ...] = ()
    #: The reasoning the prompt opened, where its end matters: a thinking budget, or a
    #: grammar that must close before ``max_tokens`` (None: no reasoning, or nothing
    #: bounds it).
    reasoning: Reasoning | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


@with_config(_RECORD)
@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the most likely alternatives' (token, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
