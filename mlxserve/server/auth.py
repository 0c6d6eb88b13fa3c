"""Bearer-token auth for /v1/*, as pure ASGI middleware.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and contextvars pass
through untouched. Keys are compared with `hmac.compare_digest` against every
configured key, so the time taken says nothing about how much of a key matched
or which key it was. /health, /ready and /metrics stay open for probes; /status is
guarded, as it shows the policy plan, and /tokenize and /detokenize, as they run the
model's tokenizer for the caller like the /v1 routes do. Anthropic's clients send
their key as ``x-api-key``: it is checked against the same keys.
"""

import hmac
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxserve.server.errors import Unauthorized, error_response

PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = ("/v1", "/status", "/tokenize", "/detokenize")


class BearerAuth:
    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys if key]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not self._protected(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self._valid(token.strip().encode()):
            await self.app(scope, receive, send)
            return
        key = headers.get("x-api-key")
        if key is not None and self._valid(key.strip().encode()):
            await self.app(scope, receive, send)
            return
        error = Unauthorized(
            "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error_response(error, scope["path"])(scope, receive, send)

    @staticmethod
    def _protected(path: str) -> bool:
        return path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS

    def _valid(self, token: bytes) -> bool:
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(token, key)
        return matched
