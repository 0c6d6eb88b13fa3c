"""Another OpenAI-compatible server as a backend, over HTTP (httpx).

The prompt is sent as text (the front's token ids decoded), which any
OpenAI-compatible server accepts, to its /completions endpoint with streaming;
the text that comes back is re-encoded with the front's tokenizer, so the
router can count tokens and resume as it does with a local engine. Resumption
is exact only when the remote uses the same tokenizer and model.

Every field of `GenerationParams` reaches the remote (`completion_body`) or the
request is refused naming it: a field dropped on the way would be a request
answered differently than asked (an ``ignore_eos`` lost stopped resumed streams
early), without anyone told. Failures are classified as the remote states them:
its refusal (a 4xx) is `BackendRejected`, its report that this request failed
(mlxserve's ``request_failed``) is `BackendRequestFailed`, anything else of its
own (a 5xx, a 429, a dropped connection) is `BackendUnavailable`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from mlxserve.channel.request import GenerationParams
from mlxserve.server.backends.base import (
    Backend,
    BackendError,
    BackendEvent,
    BackendInfo,
    BackendRejected,
    BackendRequestFailed,
    BackendUnavailable,
    Finished,
    Tokens,
)
from mlxserve.server.errors import RequestFailed
from mlxserve.server.tokenizer import FrontTokenizer

CONNECT_TIMEOUT_S = 5.0
#: The error code with which mlxserve reports a failure of the request itself.
REQUEST_FAILED = RequestFailed.code


def refused_fields(params: GenerationParams) -> list[str]:
    """The fields of ``params`` no /completions body can carry, asked for."""
    asked = {
        # llguidance's grammar has no /completions field; a schema as chat's
        # response_format would be another request (the prompt is built already).
        "grammar": params.grammar is not None,
        # Logprobs come back per piece of text, not per token id of this tokenizer.
        "logprobs": params.sampling.logprobs is not None,
        # No /completions field forces a reasoning's end marker at a budget.
        "reasoning": params.reasoning is not None and params.reasoning.budget_tokens is not None,
    }
    return [name for name, on in asked.items() if on]


def completion_body(params: GenerationParams, model: str, prompt: str) -> dict[str, Any]:
    """The streaming /completions body of ``params``: every field but the
    `refused_fields` carried.

    A field at its neutral value is left out, so a plain request suits any
    OpenAI-compatible server; the vendor extensions (``ignore_eos``, ``top_k``,
    ``min_p``, ``repetition_penalty``, as in vLLM and mlxserve) are sent only when
    asked for, and a server without them refuses them by name (its 4xx).
    ``stop_token_ids`` is the model's EOS ids or none: the remote serves the same
    model and stops at its own EOS, so only "none" (``ignore_eos``) is sent.
    ``grammar_prefix`` is the prompt's own tail, which the prompt text carries;
    it matters only to a grammar and a thinking budget, which are refused; so does a
    ``reasoning`` without a budget (where its end is, for a grammar's closing).
    """
    sampling = params.sampling
    repetition = sampling.repetition_penalty
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": params.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    optional: dict[str, Any] = {
        "seed": sampling.seed,
        "ignore_eos": True if not params.stop_token_ids else None,
        "top_k": sampling.top_k or None,
        "min_p": sampling.min_p or None,
        "presence_penalty": sampling.presence_penalty or None,
        "frequency_penalty": sampling.frequency_penalty or None,
        "repetition_penalty": None if repetition == 1 else repetition,
        "logit_bias": {str(t): b for t, b in sampling.logit_bias} or None,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    return body


class RemoteBackend(Backend):
    kind = "remote"

    def __init__(
        self,
        name: str,
        url: str,
        *,
        tokenizer: FrontTokenizer,
        api_key: str | None,
        request_timeout_s: float,
        context_length: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(name)
        self.url = url.rstrip("/")
        self._tokenizer = tokenizer
        self._api_key = api_key
        self._timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S)
        self._context_length = context_length
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._model = ""

    @property
    def connected(self) -> bool:
        return self._client is not None

    async def start(self) -> BackendInfo:
        await self.stop()
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=self._timeout, transport=self._transport
        )
        try:
            response = await self._client.get("/models")
        except httpx.HTTPError as exc:
            await self.stop()
            raise BackendUnavailable(f"remote '{self.name}' unreachable: {exc}") from None
        if response.status_code != 200:
            await self.stop()
            raise BackendUnavailable(
                f"remote '{self.name}': /models answered {response.status_code}"
            )
        models = response.json().get("data") or [{}]
        self._model = str(models[0].get("id", ""))
        context = int(models[0].get("context_length") or self._context_length)
        self.info = BackendInfo(
            model=self._model,
            context_length=context,
            eos_token_ids=tuple(self._tokenizer.eos_token_ids),
        )
        return self.info

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self.set_healthy(False)

    async def generate(
        self, request_id: str, params: GenerationParams
    ) -> AsyncGenerator[BackendEvent, None]:
        if self._client is None:
            raise BackendUnavailable(f"remote '{self.name}' is not connected")
        refused = refused_fields(params)
        if refused:  # refused, not answered otherwise than asked
            raise BackendRejected(
                f"remote '{self.name}' cannot honour {' and '.join(refused)} (an "
                "OpenAI-compatible /completions has no such field); it needs a local engine"
            )
        body = completion_body(params, self._model, self._tokenizer.decode(list(params.prompt_ids)))
        self.state.in_flight += 1
        try:
            async with self._client.stream("POST", "/completions", json=body) as response:
                if response.status_code != 200:
                    raise await self._refusal(response)
                async for event in self._events(response, len(params.prompt_ids)):
                    yield event
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"remote '{self.name}': {exc!r}") from None
        finally:
            self.state.in_flight -= 1

    async def _events(
        self, response: httpx.Response, prompt_tokens: int
    ) -> AsyncGenerator[BackendEvent, None]:
        generated = 0
        reason: str | None = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                kind = _failure_kind(error)
                raise kind(f"remote '{self.name}': {_message(error)}")
            for choice in chunk.get("choices") or []:
                ids = self._tokenizer.text_ids(choice.get("text") or "")
                if ids:
                    generated += len(ids)
                    self.proof_of_life()
                    yield Tokens(tuple(ids))
                reason = choice.get("finish_reason") or reason
        if reason is None:
            raise BackendUnavailable(f"remote '{self.name}' ended the stream without finishing")
        yield Finished(
            reason="length" if reason == "length" else "stop",
            prompt_tokens=prompt_tokens,
            completion_tokens=generated,
        )

    async def _refusal(self, response: httpx.Response) -> BackendError:
        """The failure a non-200 answer states, as its status and error code say."""
        status = response.status_code
        raw = await response.aread()
        try:
            error = json.loads(raw).get("error")
        except (ValueError, AttributeError):
            error = None
        detail = _message(error) if error is not None else raw[:300].decode(errors="replace")
        message = f"remote '{self.name}' answered {status}: {detail}"
        if status >= 500 or status == 429:
            kind = _failure_kind(error) if status == 500 else BackendUnavailable
            return kind(message)
        return BackendRejected(message)


def _failure_kind(error: object) -> type[BackendRequestFailed | BackendUnavailable]:
    """A remote's error of this request only (mlxserve's ``request_failed``), or its own."""
    code = error.get("code") if isinstance(error, dict) else None
    return BackendRequestFailed if code == REQUEST_FAILED else BackendUnavailable


def _message(error: object) -> str:
    """An OpenAI-shaped error's message (else the error as it came), kept short."""
    message = error.get("message") if isinstance(error, dict) else None
    return str(message if message is not None else error)[:300]
