"""Another OpenAI-compatible server as a backend, over HTTP (httpx).

The prompt is sent as text (the front's token ids decoded), which any
OpenAI-compatible server accepts, to its /completions endpoint with streaming;
the text that comes back is re-encoded with the front's tokenizer, so the
router can count tokens and resume as it does with a local engine. Resumption
is exact only when the remote uses the same tokenizer and model.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import httpx

from mlxserve.server.backends.base import (
    Backend,
    BackendEvent,
    BackendInfo,
    BackendRejected,
    BackendUnavailable,
    Finished,
    GenerationParams,
    Tokens,
)
from mlxserve.server.codec import Codec

CONNECT_TIMEOUT_S = 5.0


class RemoteBackend(Backend):
    kind = "remote"

    def __init__(
        self,
        name: str,
        url: str,
        *,
        codec: Codec,
        api_key: str | None,
        request_timeout_s: float,
        context_length: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(name)
        self.url = url.rstrip("/")
        self._codec = codec
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
            eos_token_ids=tuple(self._codec.eos_token_ids),
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
        if not params.plain:
            # A text prompt to /completions cannot carry a grammar, a resumed grammar
            # state or token logprobs faithfully: refused, not answered differently.
            raise BackendRejected(
                f"remote '{self.name}' serves only temperature, top_p and seed; "
                "grammars, penalties, logit_bias, top_k, min_p and logprobs need a local engine"
            )
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": self._codec.decode(list(params.prompt_ids)),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if params.seed is not None:
            body["seed"] = params.seed
        self.state.in_flight += 1
        try:
            async with self._client.stream("POST", "/completions", json=body) as response:
                if response.status_code >= 500 or response.status_code == 429:
                    raise BackendUnavailable(
                        f"remote '{self.name}' answered {response.status_code}"
                    )
                if response.status_code != 200:
                    detail = (await response.aread())[:300].decode(errors="replace")
                    raise BackendRejected(
                        f"remote '{self.name}' answered {response.status_code}: {detail}"
                    )
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
                raise BackendUnavailable(f"remote '{self.name}': {chunk['error']}")
            for choice in chunk.get("choices") or []:
                ids = self._codec.text_ids(choice.get("text") or "")
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
