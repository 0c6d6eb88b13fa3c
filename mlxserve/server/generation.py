"""One generation request, from validated input to text deltas, shared by both APIs.

The order is deliberate: everything that can be refused (unknown model, prompt
too long, tokens out of range) is refused before a slot is taken or a backend
is touched, so an invalid request never reaches an engine.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any

from mlxserve.channel.request import GenerationParams, Reasoning, SamplingParams, TokenLogprob
from mlxserve.server.admission import Admission
from mlxserve.server.backends.base import (
    BackendRejected,
    BackendRequestFailed,
    BackendUnavailable,
    Finished,
    Tokens,
)
from mlxserve.server.errors import (
    BadGateway,
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    ModelNotFound,
    RequestFailed,
    ServiceUnavailable,
)
from mlxserve.server.metrics import Metrics
from mlxserve.server.protocol import SEED_RANGE
from mlxserve.server.router import Job, Router
from mlxserve.server.stops import TextStream
from mlxserve.server.tokenizer import FrontTokenizer


@dataclass(frozen=True)
class Prepared:
    request_id: str
    params: GenerationParams
    stops: list[str]
    # The text goes on from the prompt (a completion): its first space is kept.
    continues_prompt: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.params.prompt_ids)


@dataclass(frozen=True)
class Delta:
    """New text for the client; the last delta carries the finish reason and usage."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    speculative: dict[str, Any] | None = None
    backend: str | None = None  # the backend that produced it (after failovers, the last)
    token_ids: tuple[int, ...] = ()  # the last delta: every completion token
    logprobs: tuple[TokenLogprob, ...] | None = None  # of this delta's tokens, when asked
    stop_string: str | None = None  # the last delta: the stop string that ended the text
    new_tokens: int = 0  # the tokens this delta's text came from (running usage counts them)


class Generations:
    def __init__(
        self,
        *,
        tokenizer: FrontTokenizer,
        router: Router,
        admission: Admission,
        metrics: Metrics,
        model_name: str,
        aliases: tuple[str, ...] = (),
        context_length: Callable[[], int | None],
        stop_token_ids: Callable[[], tuple[int, ...]],
        retry_after_s: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.router = router
        self.admission = admission
        self.metrics = metrics
        self.model_name = model_name
        self.model_names = (model_name, *aliases)  # what a request may send as `model`
        self.context_length = context_length
        self.stop_token_ids = stop_token_ids
        self.retry_after_s = retry_after_s
        self.vocab_size = tokenizer.vocab_size

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise ModelNotFound(
                f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
            )

    def checked_ids(self, ids: list[int], *, param: str) -> list[int]:
        """``ids`` if every one is in the vocabulary, else a 400 naming the first that is not."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is not in the vocabulary", param=param)
        return ids

    def prompt_ids(self, text: str, *, param: str) -> list[int]:
        """The prompt's token ids; a prompt that cannot fit the context is refused from
        its size first (`FrontTokenizer.min_tokens`), without being tokenized, with the same 400
        as `prepare` gives it: tokenizing megabytes takes seconds and far more memory
        than the text, for an answer known in advance."""
        context = self.context_length()
        least = self.tokenizer.min_tokens(text) if context is not None else 0
        if context is not None and least >= context:
            raise ContextLengthExceeded(
                f"the prompt has at least {least} tokens; the model's context is {context}",
                param=param,
            )
        return self.tokenizer.text_ids(text)

    def prepare(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int | None,
        sampling: SamplingParams,
        stops: list[str],
        grammar: str | None = None,
        ignore_eos: bool = False,
        limit_param: str = "max_tokens",
        prompt_param: str = "messages",
        continues_prompt: bool = False,
        reasoning: Reasoning | None = None,
    ) -> Prepared:
        """Checked parameters of one generation: ``sampling`` as the API edge read it
        from the body (`mlxserve.server.routes.common.sampling_of`), carried unchanged.

        With a ``grammar``, a limit too small for any answer it allows (the reasoning's
        end marker first, where ``reasoning`` says the prompt opened one) is a 400 naming
        ``limit_param``: the engine could not finish the answer before it."""
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        self.checked_ids(prompt_ids, param="prompt")
        context = self.context_length()
        if context is None:
            raise ServiceUnavailable("no backend has started yet", self.retry_after_s)
        if len(prompt_ids) >= context:
            raise ContextLengthExceeded(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}",
                param=prompt_param,
            )
        if max_tokens is None:
            max_tokens = context - len(prompt_ids)
        elif len(prompt_ids) + max_tokens > context:
            raise ContextLengthExceeded(
                f"the prompt ({len(prompt_ids)} tokens) plus {limit_param} ({max_tokens}) "
                f"exceeds the model's context of {context} tokens",
                param=limit_param,
            )
        self.checked_ids([token for token, _ in sampling.logit_bias], param="logit_bias")
        if grammar is not None:
            self._refuse_short(grammar, reasoning, max_tokens, limit_param)
        params = GenerationParams(
            prompt_ids=tuple(prompt_ids),
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=() if ignore_eos else self.stop_token_ids(),
            grammar=grammar,
            reasoning=reasoning,
        )
        return Prepared(uuid.uuid4().hex, params, stops, continues_prompt)

    def _refuse_short(
        self, grammar: str, reasoning: Reasoning | None, max_tokens: int, limit_param: str
    ) -> None:
        opening = list(reasoning.end_ids) if reasoning is not None else []
        need = self.tokenizer.closing_tokens(grammar, opening)
        if need is not None and max_tokens < need:
            after = " (the reasoning's end marker included)" if opening else ""
            raise InvalidRequest(
                f"{limit_param} is {max_tokens}: the shortest answer the request's "
                f"response_format or forced tool call allows takes {need} tokens{after}; "
                f"ask for at least {need}",
                param=limit_param,
            )

    def again(self, prepared: Prepared, index: int) -> Prepared:
        """Choice ``index`` of an n-choice request: its own id and its own seed."""
        sampling = prepared.params.sampling
        seed = None if sampling.seed is None else (sampling.seed + index) % SEED_RANGE
        params = replace(prepared.params, sampling=replace(sampling, seed=seed))
        return Prepared(uuid.uuid4().hex, params, prepared.stops, prepared.continues_prompt)

    async def run(self, prepared: Prepared) -> AsyncGenerator[Delta, None]:
        """Deltas of text; raises an `APIError` if the request cannot be served."""
        arrived = time.perf_counter()
        async with self.admission.slot():
            job = Job(prepared.request_id, prepared.params)
            detokenizer = (
                self.tokenizer.continuation_detokenizer()
                if prepared.continues_prompt
                else self.tokenizer.detokenizer()
            )
            text = TextStream(detokenizer, prepared.stops)
            last = None
            finish: Finished | None = None
            events = self.router.generate(job)
            try:
                async for event in events:
                    if isinstance(event, Tokens):
                        now = time.perf_counter()
                        self._observe_latency(arrived, last, now, len(event.token_ids))
                        last = now
                        yield Delta(
                            text.push(list(event.token_ids)),
                            backend=job.backend,
                            logprobs=event.logprobs,
                            new_tokens=len(event.token_ids),
                        )
                        if text.stopped:
                            break
                    else:
                        finish = event
                        break
            except BackendUnavailable as exc:
                raise ServiceUnavailable(
                    f"no backend could finish the request: {exc}", self.retry_after_s
                ) from None
            except BackendRejected as exc:
                raise BadGateway(str(exc)) from None
            except BackendRequestFailed as exc:
                raise RequestFailed(f"the request failed: {exc}") from None
            finally:
                await events.aclose()
            yield self._last(prepared, job, text, finish, arrived)

    def _observe_latency(self, arrived: float, last: float | None, now: float, n: int) -> None:
        if last is None:
            self.metrics.ttft.observe(now - arrived)
            return
        gap = (now - last) / n  # a speculative step delivers several tokens at once
        for _ in range(n):
            self.metrics.itl.observe(gap)

    def _last(
        self,
        prepared: Prepared,
        job: Job,
        text: TextStream,
        finish: Finished | None,
        arrived: float,
    ) -> Delta:
        if finish is not None and finish.reason == "cancelled":
            if self.admission.draining:
                raise ServiceUnavailable(
                    "the server shut down before the request finished",
                    self.retry_after_s,
                    code="shutting_down",
                )
            raise InternalError("the backend cancelled the request")
        tail = text.finish()
        reason = "stop" if text.stopped or finish is None else finish.reason
        completion = len(job.sent)
        self.metrics.prompt_tokens.inc(prepared.prompt_tokens)
        cached = finish.cached_tokens if finish is not None else 0
        self.metrics.cached_prompt_tokens.inc(cached)
        self.metrics.prefilled_prompt_tokens.inc(max(prepared.prompt_tokens - cached, 0))
        self.metrics.completion_tokens.inc(completion)
        self.metrics.duration.observe(time.perf_counter() - arrived)
        speculative = finish.speculative if finish is not None else None
        if finish is not None and finish.memory:
            self.metrics.record_memory(finish.memory, job.backend)
        if speculative:
            chosen = speculative.get("depths_chosen")
            self.metrics.record_speculative(
                int(speculative.get("drafted", 0)),
                int(speculative.get("accepted", 0)),
                {str(k): int(v) for k, v in chosen.items()} if isinstance(chosen, dict) else None,
                speculative.get("acceptance_rate_per_depth"),
            )
        return Delta(
            tail,
            finish_reason=reason,
            prompt_tokens=prepared.prompt_tokens,
            completion_tokens=completion,
            cached_tokens=cached,
            speculative=speculative,
            backend=job.backend,
            token_ids=tuple(job.sent),
            stop_string=text.matched,
        )
