"""Count every HTTP request by endpoint and status, as pure ASGI middleware.

Unknown paths are counted under one label, so a scanner or a fuzzer cannot
grow the metric without bound.
"""

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxserve.server.metrics import Metrics

OTHER = "other"


class RequestCounter:
    def __init__(self, app: ASGIApp, metrics: Metrics, endpoints: Iterable[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = set(endpoints)

    def _endpoint(self, path: str) -> str:
        if path in self.endpoints:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{model}"
        return OTHER

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started

        async def watched_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            self.metrics.requests.labels(self._endpoint(scope["path"]), str(status)).inc()
