"""A request-body size limit, as pure ASGI middleware.

Checked twice: a declared Content-Length over the limit is refused before the
body is read, and a chunked body is counted as it arrives, so a client cannot
make the front buffer more than the limit either way.
"""

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxserve.server.errors import BodyTooLarge, error_response


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _error(self) -> BodyTooLarge:
        return BodyTooLarge(f"the request body is larger than {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._error(), scope["path"])(scope, receive, send)
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised into the handler reading the body; mapped to 413 there.
                    raise self._error()
            return message

        await self.app(scope, counted_receive, send)
